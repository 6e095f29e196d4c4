"""GGUF files of a checkpoint, made by llama.cpp's own converter (convert_hf_to_gguf.py), which
comes from the sdist of the installed llama-cpp-python (downloaded with pip) or from a llama.cpp
source tree named on the command line."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from .random_checkpoint import LLAMA, checkpoint
from .record import CACHE, pip_download


def fetch_converter(dest: Path) -> Path:
    """convert_hf_to_gguf.py (and its ``conversion`` package) from the sdist of the installed
    llama-cpp-python, downloaded with pip into ``dest`` (see :func:`extract_converter`)."""
    import llama_cpp

    version = llama_cpp.__version__
    out = dest / f"llama.cpp-{version}"
    script = out / "convert_hf_to_gguf.py"
    if script.is_file() and (out / "gguf-py" / "gguf").is_dir():
        return script
    with tempfile.TemporaryDirectory() as tmp:
        pip_download(Path(tmp), "--no-binary", ":all:", f"llama-cpp-python=={version}")
        return extract_converter(next(Path(tmp).glob("llama_cpp_python-*.tar.gz")), out)


def extract_converter(sdist: Path, out: Path) -> Path:
    """The converter of a llama-cpp-python sdist's vendored llama.cpp, extracted into ``out``:
    convert_hf_to_gguf.py, its ``conversion`` package and the ``gguf-py`` beside them, which the
    converter puts ahead of an installed gguf (PyPI's release of the same version number can
    lack what the converter uses, e.g. ``gguf.LazyChunkedTensor``). Returns the script."""
    prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
    wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
    with tarfile.open(sdist) as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith(prefix) and m.name[len(prefix) :].startswith(wanted)
        ]
        for m in members:
            m.name = m.name[len(prefix) :]
        tar.extractall(out, members=members, filter="data")
    script = out / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise FileNotFoundError(f"{sdist.name} has no vendor/llama.cpp/convert_hf_to_gguf.py")
    return script


def convert(
    folder: Path,
    converter: Path,
    outtype: str,
    dest: Path,
    tag: str = LLAMA.tag,
    vocab_as_llama: tuple[str, str] | None = None,
) -> Path:
    """``folder`` (the checkpoint tagged ``tag``) as a GGUF of ``outtype`` (f32, bf16, q8_0),
    made once by llama.cpp's converter (``vocab_as_llama``: see Checkpoint)."""
    out = dest / f"{tag}-{outtype}.gguf"
    if not out.is_file():
        tmp = out.with_suffix(".part")
        argv = [str(converter), str(folder), "--outtype", outtype, "--outfile", str(tmp)]
        command = [sys.executable, *argv]
        if vocab_as_llama is not None:  # the converter run with that class patched
            module, cls = vocab_as_llama
            here = converter.parent
            command = [sys.executable, "-c", (
                "import importlib, runpy, sys\n"
                f"sys.path[:0] = [{str(here)!r}, {str(here / 'gguf-py')!r}]\n"
                f"c = getattr(importlib.import_module({module!r}), {cls!r})\n"
                "c.set_vocab = lambda self: self._set_vocab_llama_hf()\n"
                f"sys.argv = {argv!r}\n"
                f"runpy.run_path({str(converter)!r}, run_name='__main__')\n"
            )]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{converter} --outtype {outtype} failed:\n{done.stderr[-4000:]}")
        tmp.rename(out)
    return out


def add_gguf_arguments(ap: argparse.ArgumentParser) -> None:
    """``--converter``, ``--fetch-converter`` and ``--cache``, as :func:`converter_from` and
    :func:`f32_checkpoint` read them."""
    ap.add_argument("--converter", type=Path, help="llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--fetch-converter", action="store_true",
                    help="take the converter from the installed llama-cpp-python's sdist (pip)")  # fmt: skip
    ap.add_argument("--cache", type=Path, default=CACHE, help="checkpoint and GGUF files")


def converter_from(args: argparse.Namespace, ap: argparse.ArgumentParser, why: str) -> Path:
    """The converter ``--converter`` names, or the one ``--fetch-converter`` fetches; a usage
    error saying ``why`` one is needed when neither is given."""
    converter = args.converter or (fetch_converter(args.cache) if args.fetch_converter else None)
    if converter is None:
        ap.error(f"{why}: pass --converter PATH or --fetch-converter")
    return converter


def f32_checkpoint(args: argparse.Namespace, ap: argparse.ArgumentParser) -> tuple[Path, Path]:
    """This benchmark's checkpoint folder and its f32 GGUF under ``args.cache``; the GGUF is
    converted only when missing (a usage error then without a converter)."""
    folder = checkpoint(args.cache)
    gguf = args.cache / f"{LLAMA.tag}-f32.gguf"
    if not gguf.is_file():
        converter = converter_from(args, ap, "the f32 GGUF is not made yet")
        gguf = convert(folder, converter, "f32", args.cache)
    return folder, gguf
