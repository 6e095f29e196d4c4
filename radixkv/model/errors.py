"""Errors raised while loading a model."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model folder is missing a file, has a malformed file, or does not fit the architecture.

    The message always names the file and, where there is one, the field or tensor.
    """

    def __init__(self, file: str, field: str | None, problem: str) -> None:
        self.file = file
        self.field = field
        self.problem = problem
        where = f"{file}: field {field!r}" if field else file
        super().__init__(f"{where}: {problem}")
