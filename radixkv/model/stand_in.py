"""A stand-in for an asynchronous device on a CPU: a model whose forward takes a set time, most
of it asleep, when the host is free (``time.sleep`` releases the GIL), as a GPU computes while
the host's Python goes on. The engine's overlap (engine/overlap.py) is measured and tested with it
(bench/bench_overlap.py, tests/test_engine_overlap.py): a step should then cost about
max(host work, device time) with overlap and their sum without."""

from __future__ import annotations

import time
from typing import Any


class StandInDevice:
    """Wraps a model (``ModelRunner.model``): each forward (``__call__`` or ``trunk``) runs the
    model, then sleeps whatever is left of ``seconds``, so a forward takes
    max(``seconds``, the model's own time), as a device's kernels take their time whatever
    the host does. Everything else is the model's. ``model_seconds`` adds up the wall time of
    the model's own forwards (the sleep excluded)."""

    def __init__(self, model: Any, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds!r}")
        self.model = model
        self.seconds = seconds
        self.model_seconds = 0.0

    def _timed(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            took = time.perf_counter() - t
            self.model_seconds += took
            if took < self.seconds:
                time.sleep(self.seconds - took)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(self.model, *args, **kwargs)

    def trunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(self.model.trunk, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)
