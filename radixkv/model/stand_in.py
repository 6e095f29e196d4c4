"""A stand-in for an asynchronous device on a CPU: a model whose forward also takes a set time
during which the host is free (``time.sleep`` releases the GIL), as a GPU computes while the
host's Python goes on. The engine's overlap (engine/overlap.py) is measured and tested with it
(bench/bench_overlap.py, tests/test_engine_overlap.py): a step should then cost about
max(host work, device time) with overlap and their sum without."""

from __future__ import annotations

import time
from typing import Any


class StandInDevice:
    """Wraps a model (``ModelRunner.model``): each forward (``__call__`` or ``trunk``) sleeps
    ``seconds`` first; everything else is the model's."""

    def __init__(self, model: Any, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds!r}")
        self.model = model
        self.seconds = seconds

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self.seconds)
        return self.model(*args, **kwargs)

    def trunk(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self.seconds)
        return self.model.trunk(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)
