"""The engine's own cost per step: ``Engine.step()`` timed phase by phase, the forward excluded.

A random Llama so small that its forward is negligible (hidden 64, one layer, one 64-dim head;
radixkv-tiny's byte tokenizer) runs steady decode batches: B requests share a 256-token system
prompt (so ``cascade="auto"`` plans a shared level) plus 8 to 23 tokens of their own (so they
complete pages on different steps), and decode with
``ignore_eos`` and a ``max_tokens`` they never reach while measured. Scenarios: decode at
B = 1, 32, 256, 512 greedy; B = 256 with top-p/top-k sampling, with ``stream=False``, with the
cascade off; and a mixed step (B = 248 decoding while 8 x 256-token prompts are admitted and
prefilled whole in the same step). The same run also times radixkv-tiny's whole step (forward
included) at B = 256 for scale.

Times are this thread's CPU time (``time.thread_time``; the micro model runs torch on one
thread), which other processes on a shared machine cannot inflate; radixkv-tiny's step is
wall time (its forward uses every core). Each step is split into phases by wrapping the engine's methods on the instance (whichever of
them the engine under test has; what no wrapped phase covers is ``other``). The model's own
forward (``runner.model``: embeddings, layers, attention kernels, head) is timed and excluded;
the runner's input preparation (token/position tensors, the attention plan) is overhead
(``prepare``). Per scenario: the median over the measured steps of the overhead per step, per
batch row ("per token": decode rows each make one token) and each phase's median.

``--compare DIR`` runs DIR's engine (another checkout, e.g. ``main``) side by side: each side is
a worker subprocess with its checkout first on ``sys.path`` and this harness; per scenario the
two run back to back (alternating which goes first) for ``--rounds`` rounds, and each number is
the median over rounds (the machine is shared).

    python bench/bench_overhead.py [--quick] [--compare DIR] [--rounds N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from peerkit import load_average, machine_line, results_path, utc_now, write_json

ROOT = Path(__file__).resolve().parents[1]

SCENARIOS: dict[str, dict[str, Any]] = {
    "decode B=1": dict(batch=1),
    "decode B=32": dict(batch=32),
    "decode B=256 greedy": dict(batch=256),
    "decode B=256 stream=False": dict(batch=256, stream=False),
    "decode B=256 top-p/top-k": dict(batch=256, sampled=True),
    "decode B=256 cascade off": dict(batch=256, cascade="off"),
    "decode B=512": dict(batch=512),
    "mixed B=248 + 8 x 256-token prompts": dict(batch=248, prompts=8, prompt_len=256),
    "radixkv-tiny decode B=256 (forward included)": dict(batch=256, tiny=True),
}
SHARED = 256  # system prompt tokens every request shares
OWN = 8  # tokens of each request's own


# ---------------------------------------------------------------------------- the worker side
def micro_model() -> Any:
    """The random hidden-64, one-layer Llama (a LoadedModel)."""
    import dataclasses

    import torch

    from radixkv.model.llama import LlamaForCausalLM
    from radixkv.model.loader import LoadedModel
    from radixkv.model.tiny import tiny_config, tiny_tokenizer

    cfg = dataclasses.replace(
        tiny_config(), hidden_size=64, intermediate_size=128, num_layers=1, num_heads=1
    )
    model = LlamaForCausalLM(cfg, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return LoadedModel(model.eval(), cfg, tiny_tokenizer(), "micro-llama")


# the clock: this thread's CPU time for the micro model (one torch thread: all of a step's work
# is on this thread, and time the shared machine gives to other processes is not counted), the
# wall clock for radixkv-tiny (its forward uses every core)
_clock: Callable[[], float] = time.thread_time


class _Phases:
    """Wraps methods on instances; accumulates each phase's seconds for the current step."""

    def __init__(self) -> None:
        self.now: dict[str, float] = {}

    def wrap(self, obj: Any, attr: str, label: str) -> None:
        fn = getattr(obj, attr, None)
        if fn is None:
            return
        now = self.now

        def timed(*a: Any, **k: Any) -> Any:
            t = _clock()
            try:
                return fn(*a, **k)
            finally:
                now[label] = now.get(label, 0.0) + _clock() - t

        setattr(obj, attr, timed)


class _TimedModel:
    """Stands in for ``runner.model``: times the forward, delegates everything else."""

    def __init__(self, model: Any, phases: _Phases) -> None:
        self._m = model
        self._p = phases

    def _timed(self, fn: Callable[..., Any], *a: Any, **k: Any) -> Any:
        t = _clock()
        try:
            return fn(*a, **k)
        finally:
            now = self._p.now
            now["forward"] = now.get("forward", 0.0) + _clock() - t

    def __call__(self, *a: Any, **k: Any) -> Any:
        return self._timed(self._m, *a, **k)

    def trunk(self, *a: Any, **k: Any) -> Any:
        return self._timed(self._m.trunk, *a, **k)

    def head(self, *a: Any, **k: Any) -> Any:
        return self._timed(self._m.head, *a, **k)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._m, name)


def _instrument(eng: Any) -> _Phases:
    ph = _Phases()
    sch = eng.scheduler
    for obj, attr, label in (
        (sch, "schedule", "schedule"),
        (eng, "_plan_cascade", "cascade plan"),
        (eng.runner, "_prepare", "prepare"),
        (eng.runner, "_last_rows", "prepare"),
        (eng, "_pick_tokens", "sampling"),
        (sch, "after_forward", "after_forward"),
        (eng, "_append_tokens", "append_tokens"),
        (eng, "drain", "drain/outputs"),
    ):
        ph.wrap(obj, attr, label)
    # model_inputs is a method of the batch class: wrap it there (this process only)
    import radixkv.engine.scheduler as scheduler_mod

    cls = scheduler_mod.ScheduledBatch
    if hasattr(cls, "model_inputs") and not getattr(cls.model_inputs, "_timed", False):
        orig = cls.model_inputs
        now = ph.now

        def model_inputs(self: Any) -> Any:
            t = _clock()
            try:
                return orig(self)
            finally:
                now["model inputs"] = now.get("model inputs", 0.0) + _clock() - t

        model_inputs._timed = True  # type: ignore[attr-defined]
        cls.model_inputs = model_inputs  # type: ignore[method-assign]
    eng.runner.model = _TimedModel(eng.runner.model, ph)
    return ph


def _run_scenario(spec: dict[str, Any], steps: int, warmup: int) -> dict[str, Any]:
    import random

    import torch

    from radixkv.engine.engine import Engine
    from radixkv.engine.params import SamplingParams

    # the micro model's few kernels run on one thread: the overhead measured is the engine's
    # single-threaded Python, and OpenMP workers spinning on a shared machine only add noise
    torch.set_num_threads(torch.get_num_threads() if spec.get("tiny") else 1)
    global _clock
    _clock = time.perf_counter if spec.get("tiny") else time.thread_time
    b = spec["batch"]
    prompts = spec.get("prompts", 0)
    plen = spec.get("prompt_len", 0)
    model = "radixkv-tiny" if spec.get("tiny") else micro_model()
    total = warmup + steps + 8
    eng = Engine(
        model,
        page_size=16,
        cascade=spec.get("cascade", "auto"),
        max_running_requests=b + prompts,
        num_pages=(b + prompts) * ((SHARED + OWN + total + max(plen, 0)) // 16 + 3) + 64,
        max_prefill_tokens=max(4096, prompts * plen + 64),
        chunked_prefill_size=max(4096, prompts * plen + 64),
    )
    eng.scheduler.step_overhead_tokens = None  # admit the mixed step's prompts together
    rng = random.Random(0)
    system = [rng.randrange(0, 250) for _ in range(SHARED)]
    if spec.get("sampled"):
        params = [
            SamplingParams(
                temperature=0.8, top_p=0.9, top_k=40, max_tokens=total + 64, ignore_eos=True,
                seed=i,
            )
            for i in range(b)
        ]  # fmt: skip
    else:
        params = [SamplingParams(temperature=0.0, max_tokens=total + 64, ignore_eos=True)] * b
    stream = spec.get("stream", True)
    for i in range(b):
        # OWN to OWN + 15 tokens: requests cross page boundaries (and publish pages) on
        # different steps, as they do in a server, not all on the same one
        own = [rng.randrange(0, 250) for _ in range(OWN + i % 16)]
        eng.add_request(system + own, params[i], stream=stream)
    while eng.scheduler.waiting or any(
        s.num_computed < len(s.token_ids) - 1 for s in eng.scheduler.running
    ):
        eng.step()  # prefill every request: steady decode from here
    ph = _instrument(eng)
    over: list[float] = []
    fwd: list[float] = []
    per_phase: dict[str, list[float]] = {}
    rows: list[int] = []
    tokens: list[int] = []
    extra: list[str] = []
    for k in range(warmup + steps):
        if prompts:
            for rid in extra:
                if eng.has_request(rid):
                    eng.abort(rid)
            eng.drain()
            extra = [
                eng.add_request(
                    [rng.randrange(0, 250) for _ in range(plen)],
                    SamplingParams(max_tokens=4, ignore_eos=True),
                    stream=stream,
                )
                for _ in range(prompts)
            ]
        ph.now.clear()
        n_rows = len(eng.scheduler.running)
        t = _clock()
        eng.step()
        dt = _clock() - t
        if k < warmup:
            continue
        f = ph.now.get("forward", 0.0)
        fwd.append(f)
        over.append(dt - f)
        rows.append(len(eng.scheduler.running) if prompts else n_rows)
        tokens.append(b + prompts * plen if prompts else n_rows)
        named = 0.0
        for label, v in ph.now.items():
            if label != "forward":
                per_phase.setdefault(label, []).append(v)
                named += v
        per_phase.setdefault("other", []).append(dt - f - named)
    med = statistics.median(over)
    n_rows = statistics.median(rows)
    phases = {k: statistics.median(v) * 1e6 for k, v in per_phase.items()}
    out = {
        "batch_rows": n_rows,
        "overhead_us": med * 1e6,
        "per_row_us": med * 1e6 / n_rows,
        "per_computed_token_us": med * 1e6 / statistics.median(tokens),
        "forward_us": statistics.median(fwd) * 1e6,
        "step_us": (med + statistics.median(fwd)) * 1e6,
        "phases_us": dict(sorted(phases.items(), key=lambda kv: -kv[1])),
    }
    eng.close()
    return out


def worker(names: list[str], steps: int, warmup: int) -> dict[str, Any]:
    import radixkv

    got: dict[str, Any] = {"radixkv": str(Path(radixkv.__file__).resolve().parent.parent)}
    for name in names:
        spec = SCENARIOS[name]
        n = max(3, steps // 4) if spec.get("tiny") else steps
        got[name] = _run_scenario(spec, n, 2 if spec.get("tiny") else warmup)
    return got


# ---------------------------------------------------------------------------- the driver side
def _run_worker(checkout: Path, names: list[str], steps: int, warmup: int) -> dict[str, Any]:
    env = dict(os.environ, BENCH_OVERHEAD_CHECKOUT=str(checkout))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(names)]
    cmd += ["--steps", str(steps), "--warmup", str(warmup)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"worker for {checkout} failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per number, the median over rounds."""
    first = runs[0]
    out: dict[str, Any] = {}
    for k, v in first.items():
        if isinstance(v, dict):
            keys = {kk for r in runs for kk in r[k]}
            vals = {kk: statistics.median(r[k].get(kk, 0.0) for r in runs) for kk in keys}
            out[k] = dict(sorted(vals.items(), key=lambda kv: -kv[1]))
        else:
            out[k] = statistics.median(r[k] for r in runs)
    return out


def _line(name: str, r: dict[str, Any]) -> str:
    top = ", ".join(f"{k} {v:,.0f}" for k, v in list(r["phases_us"].items())[:4])
    return (
        f"  {name:46s} {r['overhead_us']:9,.0f} us/step {r['per_row_us']:7.1f} us/row  "
        f"(fwd {r['forward_us']:,.0f})  {top}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=30, help="measured steps per scenario")
    # 17 steps: every request has completed a page of its own (as in a long decode)
    ap.add_argument("--warmup", type=int, default=17)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (median)")
    ap.add_argument("--compare", type=Path, help="another checkout to run side by side")
    ap.add_argument("--only", help="comma-separated scenario name substrings")
    ap.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    ap.add_argument("--out", default=None, help="default bench/results/bench_overhead.json")
    args = ap.parse_args()
    if args.worker is not None:
        # the checkout under test first (peerkit put this one there)
        sys.path.insert(0, os.environ.get("BENCH_OVERHEAD_CHECKOUT", str(ROOT)))
        print(json.dumps(worker(json.loads(args.worker), args.steps, args.warmup)))
        return
    if args.quick:
        args.steps, args.rounds = 10, 1
    names = list(SCENARIOS)
    if args.only:
        keys = [s.strip() for s in args.only.split(",")]
        names = [n for n in names if any(k in n for k in keys)]
    load = load_average()
    sides = {"this": ROOT}
    if args.compare is not None:
        sides = {"base": args.compare.resolve(), "this": ROOT}
    # per scenario and round, one worker process per side, back to back (which side goes
    # first alternates), so a change of load on the shared machine hits both sides alike
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {n: [] for n in names} for s in sides}
    checkouts: dict[str, str] = {}
    for r in range(args.rounds):
        for k, name in enumerate(names):
            order = list(sides) if (r + k) % 2 == 0 else list(reversed(sides))
            for side in order:
                got = _run_worker(sides[side], [name], args.steps, args.warmup)
                checkouts[side] = got["radixkv"]
                runs[side][name].append(got[name])
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    results: dict[str, Any] = {}
    for side in sides:
        results[side] = {
            "checkout": checkouts[side],
            "scenarios": {n: _median_of(runs[side][n]) for n in names},
        }
        print(f"{side} ({results[side]['checkout']}):")
        for n in names:
            print(_line(n, results[side]["scenarios"][n]))
    table = []
    for n in names:
        row: dict[str, Any] = {"scenario": n}
        for side in sides:
            r = results[side]["scenarios"][n]
            row[f"{side} us/step"] = round(r["overhead_us"])
            row[f"{side} us/row"] = round(r["per_row_us"], 1)
        if "base" in sides:
            row["speedup"] = round(
                results["base"]["scenarios"][n]["overhead_us"]
                / results["this"]["scenarios"][n]["overhead_us"],
                2,
            )
        r = results["this"]["scenarios"][n]
        row["largest phases (us)"] = ", ".join(
            f"{k} {v:,.0f}" for k, v in list(r["phases_us"].items())[:4]
        )
        table.append(row)
    data = {
        "date": utc_now(),
        "machine": machine_line(load),
        "model": f"random Llama, hidden 64, 1 layer; {SHARED} shared + {OWN}..{OWN + 15} own "
        "prompt tokens",
        "steps": args.steps,
        "rounds": args.rounds,
        "table": table,
        "sides": results,
    }
    write_json(args.out or results_path("bench_overhead"), data)


if __name__ == "__main__":
    main()
