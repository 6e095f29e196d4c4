"""bench_peers takes llama.cpp's GGUF converter, and the gguf-py it is written for, from the
llama-cpp-python sdist (a fresh ``nox -s bench_peers`` failed when only the script and its
package came out, and PyPI's gguf of the same version number lacked what the script uses)."""

from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench_peers import convert, extract_converter


def _sdist(path: Path, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"llama_cpp_python-9.9.9/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_extracts_the_script_its_package_and_the_vendored_gguf(tmp_path: Path) -> None:
    vendor = "vendor/llama.cpp/"
    sdist = _sdist(
        tmp_path / "llama_cpp_python-9.9.9.tar.gz",
        {
            vendor + "convert_hf_to_gguf.py": "print('convert')",
            vendor + "conversion/base.py": "x = 1",
            vendor + "gguf-py/gguf/__init__.py": "LazyChunkedTensor = object",
            vendor + "ggml/src/ggml.c": "int main;",  # not needed: left in the archive
            "llama_cpp/__init__.py": "",
        },
    )
    script = extract_converter(sdist, tmp_path / "out")
    out = tmp_path / "out"
    assert script == out / "convert_hf_to_gguf.py" and script.read_text() == "print('convert')"
    assert (out / "conversion" / "base.py").is_file()
    assert (out / "gguf-py" / "gguf" / "__init__.py").read_text() == "LazyChunkedTensor = object"
    assert not (out / "ggml").exists() and not (out / "llama_cpp").exists()


def test_an_sdist_without_the_converter_is_named(tmp_path: Path) -> None:
    sdist = _sdist(tmp_path / "llama_cpp_python-9.9.9.tar.gz", {"README.md": "no vendor"})
    with pytest.raises(FileNotFoundError, match=r"llama_cpp_python-9\.9\.9\.tar\.gz has no"):
        extract_converter(sdist, tmp_path / "out")


def test_a_vocabulary_read_as_llama_s(tmp_path: Path) -> None:
    """A checkpoint whose architecture's converter class would read its family's own
    tokenizer (Qwen3-MoE: GPT-2 BPE) is converted with that class reading the Llama-style
    vocabulary instead; other classes and the plain path are left alone."""
    conv = tmp_path / "llama.cpp"
    (conv / "conversion").mkdir(parents=True)
    (conv / "gguf-py").mkdir()
    (conv / "conversion" / "__init__.py").write_text("")
    (conv / "conversion" / "qwen.py").write_text(
        "class Qwen3MoeModel:\n"
        "    def set_vocab(self): return 'gpt2'\n"
        "    def _set_vocab_llama_hf(self): return 'llama_hf'\n"
    )
    (conv / "convert_hf_to_gguf.py").write_text(
        "import sys\n"
        "from pathlib import Path\n"
        "sys.path.insert(1, str(Path(__file__).parent / 'gguf-py'))\n"
        "from conversion.qwen import Qwen3MoeModel\n"
        "args = sys.argv[1:]\n"
        "Path(args[args.index('--outfile') + 1]).write_text(\n"
        "    Qwen3MoeModel().set_vocab() + ' ' + args[0] + ' ' + args[2])\n"
    )
    script = conv / "convert_hf_to_gguf.py"
    folder = tmp_path / "ckpt"
    patched = convert(folder, script, "q8_0", tmp_path, "moe", ("conversion.qwen", "Qwen3MoeModel"))
    assert patched == tmp_path / "moe-q8_0.gguf"
    assert patched.read_text() == f"llama_hf {folder} q8_0"
    plain = convert(folder, script, "f32", tmp_path, "moe")
    assert plain.read_text() == f"gpt2 {folder} f32"
