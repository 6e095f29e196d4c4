"""A stand-in for an asynchronous device on a CPU: a model whose forward takes a set time, most
of it asleep, when the host is free (``time.sleep`` releases the GIL), as a GPU computes while
the host's Python goes on. The engine's overlap (engine/overlap.py) is measured and tested with it
(bench/bench_overlap.py, tests/test_engine_overlap.py): a step should then cost about
max(host work, device time) with overlap and their sum without."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch


class StandInDevice:
    """Wraps a model (``ModelRunner.model``): each forward (``__call__`` or ``trunk``) runs the
    model, then sleeps whatever is left of ``seconds``, so a forward takes
    max(``seconds``, the model's own time), as a device's kernels take their time whatever
    the host does. Everything else is the model's. ``model_seconds`` adds up the wall time of
    the model's own forwards (the sleep excluded), ``busy_seconds`` that of the whole forwards
    (a sleeping thread may wake late on a busy machine: this is the device time it really
    took).

    ``compute=False`` (benchmarks of the host's cost alone): ``__call__`` computes nothing (no
    K/V is written) and returns logits whose argmax is each row's input id plus one, so the
    device's time is exactly ``seconds`` and none of it holds the GIL or a core."""

    def __init__(self, model: Any, seconds: float, *, compute: bool = True) -> None:
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds!r}")
        self.model = model
        self.seconds = seconds
        self.compute = compute
        self.model_seconds = 0.0
        self.busy_seconds = 0.0

    def _timed(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            took = time.perf_counter() - t
            self.model_seconds += took
            if took < self.seconds:
                time.sleep(self.seconds - took)
            self.busy_seconds += time.perf_counter() - t

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(self.model if self.compute else self._no_compute, *args, **kwargs)

    def _no_compute(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: Any,
        logits_indices: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        # by NumPy on the host's copy: a torch call gives the GIL up and must win it back from
        # the host thread, which a device's own work never has to (its time is ``seconds``)
        ids = input_ids.cpu().numpy()
        if logits_indices is not None:
            ids = ids[logits_indices.cpu().numpy()]
        vocab = self.model.config.vocab_size
        logits = np.zeros((len(ids), vocab), dtype=np.float32)
        logits[np.arange(len(ids)), (ids + 1) % vocab] = 1.0
        return torch.from_numpy(logits).to(input_ids.device)

    def trunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(self.model.trunk, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)
