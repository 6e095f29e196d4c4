"""Overlap (engine/overlap.py): does a step cost max(host, device) instead of their sum?

A random Llama (hidden 64, one layer; radixkv-tiny's byte tokenizer) is served to B decoding
requests (``ignore_eos``, a ``max_tokens`` never reached while measured) on a stand-in device
(radixkv/model/stand_in.py, ``compute=False``) whose forward computes nothing and lasts ``d``
seconds asleep, which releases the GIL and the core as a GPU leaves the host free: the device
time is exactly ``d`` and the host's work (schedule, inputs, attention plan, token acceptance,
outputs) is all that runs on the CPU. Per point, on fresh engines (decoding sequences grow, and
the costs with them): the host's own time per step (``cpu``: overlap off, no device time, the
model's forward excluded), then with d = 0.5, 1, 1.5 and 2 times it, the step time with
overlap off and on, interleaved round by round (the machine is shared: each number is the
median over rounds of the mean step). Done when "on" is within 10% of max(cpu, device);
``off/(cpu+dev)`` says how much the machine itself inflates a step beyond the sum of its
parts measured apart (wake-ups of a sleeping thread on a busy machine, GIL hand-overs): the
same inflation applies to "on". The same run times radixkv-tiny's real CPU forward (no stand-in) off and
on, which decides ``overlap="auto"`` on a CPU.

    python bench/bench_overlap.py [--batch 32 256] [--steps N] [--rounds N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's radixkv, not an installed one

from bench_overhead import micro_model  # noqa: E402  (the random hidden-64 Llama)

from radixkv import onednn  # noqa: E402
from radixkv.engine.engine import Engine  # noqa: E402
from radixkv.engine.params import SamplingParams  # noqa: E402
from radixkv.model.loader import LoadedModel, load_model  # noqa: E402
from radixkv.model.stand_in import StandInDevice  # noqa: E402

FACTORS = (0.5, 1.0, 1.5, 2.0)
TEMPERATURE = 0.0  # (--temperature)


def decoding_engine(
    model: LoadedModel | str, batch: int, overlap: str, *, compute: bool = False, **kw: Any
) -> Engine:
    """An engine with ``batch`` requests admitted and decoding (shared 64-token prefix plus
    8..23 tokens of their own), the stand-in device wrapped around its model (``compute``:
    the model computes too; else the device's time is the stand-in's alone)."""
    eng = Engine(
        model,
        page_size=16,
        overlap=overlap,
        max_running_requests=batch,
        num_pages=batch * 24 + 64,
        **kw,
    )
    eng.runner.model = StandInDevice(eng.runner.model, 0.0, compute=compute)
    system = list(range(5, 69))
    # greedy, as bench_overhead's B=256 scenario (``--temperature``: sampled rows draw on the
    # worker, after the device time: on a GPU a kernel, on the stand-in host Python)
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=4_000, ignore_eos=True)
    for i in range(batch):
        eng.add_request(system + [70 + (i * 7 + j) % 150 for j in range(8 + i % 16)], params)
    for _ in range(6):  # admitted, prefilled, decoding
        eng.step()
    return eng


def step_time(eng: Engine, steps: int) -> tuple[float, float]:
    """The mean wall time of ``steps`` steady steps (seconds; with overlap a step's own call
    is not its period: one call waits for the device, the next may not) and the device's
    mean time per step as it really took (a sleep may end late on a busy machine)."""
    model = eng.runner.model
    assert isinstance(model, StandInDevice)
    b0 = model.busy_seconds
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    return (time.perf_counter() - t) / steps, (model.busy_seconds - b0) / steps


def host_and_forward(eng: Engine, steps: int) -> tuple[float, float]:
    """A sequential engine's step split into the host's part and the model's own forward
    (seconds per step, medians): the step's wall time less the forward's."""
    model = eng.runner.model
    assert isinstance(model, StandInDevice)
    whole, fwd = [], []
    for _ in range(steps):
        f0 = model.model_seconds
        t = time.perf_counter()
        eng.step()
        whole.append(time.perf_counter() - t)
        fwd.append(model.model_seconds - f0)
    f = statistics.fmean(fwd)
    return statistics.fmean(whole) - f, f


def set_device_time(eng: Engine, seconds: float) -> None:
    model = eng.runner.model
    assert isinstance(model, StandInDevice)
    model.seconds = seconds


def run_batch(model: LoadedModel, batch: int, steps: int, rounds: int) -> dict[str, Any]:
    """Per factor, fresh engines (sequences grow as they decode, and the host's and the
    forward's costs with them): the host's time and the forward's measured on the sequential
    one with no device time, then both timed with the device time set, interleaved."""
    rows = []
    for f in FACTORS:
        off = decoding_engine(model, batch, "off")
        on = decoding_engine(model, batch, "on")
        cpu, fwd = host_and_forward(off, steps)
        # the device's time per step: a forward takes max(d, the model's own time)
        d = max(f * cpu, fwd)
        set_device_time(off, d)
        set_device_time(on, d)
        t_off: list[tuple[float, float]] = []
        t_on: list[tuple[float, float]] = []
        for r in range(rounds):  # interleaved, alternating which goes first
            pair = ((off, t_off), (on, t_on)) if r % 2 == 0 else ((on, t_on), (off, t_off))
            for eng, out in pair:
                out.append(step_time(eng, steps))
        off.close()
        on.close()
        m_off = statistics.median(t for t, _ in t_off)
        m_on = statistics.median(t for t, _ in t_on)
        real = statistics.median(b for _, b in t_on)  # the on engine's device time, as taken
        target = max(cpu, real)
        rows.append(
            dict(
                factor=f,
                cpu_ms=cpu * 1e3,
                forward_ms=fwd * 1e3,
                device_ms=d * 1e3,
                device_taken_ms=real * 1e3,
                off_ms=m_off * 1e3,
                on_ms=m_on * 1e3,
                max_ms=target * 1e3,
                sum_ms=(cpu + real) * 1e3,
                on_over_max=m_on / target,
                off_over_sum=m_off / (cpu + real),
            )
        )
    return dict(batch=batch, rows=rows)


def run_real(batch: int, steps: int, rounds: int) -> dict[str, Any]:
    """radixkv-tiny's real CPU forward (every core), no stand-in: overlap off vs on."""
    torch.set_num_threads(torch.get_num_threads())
    lm = load_model("radixkv-tiny")
    off = decoding_engine(lm, batch, "off", compute=True)
    on = decoding_engine(lm, batch, "on", compute=True)
    t_off: list[float] = []
    t_on: list[float] = []
    for r in range(rounds):
        pair = ((off, t_off), (on, t_on)) if r % 2 == 0 else ((on, t_on), (off, t_off))
        for eng, out in pair:
            out.append(step_time(eng, steps)[0])
    off.close()
    on.close()
    return dict(
        batch=batch, off_ms=statistics.median(t_off) * 1e3, on_ms=statistics.median(t_on) * 1e3
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--steps", type=int, default=30, help="steps timed per measurement")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--real-batch", type=int, default=32, help="radixkv-tiny's batch (0: skip)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampled"
    )
    args = ap.parse_args()
    global TEMPERATURE
    TEMPERATURE = args.temperature
    threads = torch.get_num_threads()
    model = micro_model()
    report: dict[str, Any] = dict(temperature=TEMPERATURE, stand_in=[], real=None)
    with_plain = onednn.USE_ONEDNN
    onednn.USE_ONEDNN = False  # the micro model's products: plain (no per-shape setup)
    torch.set_num_threads(1)  # its few kernels on one thread: the host's time is the engine's
    try:
        for b in args.batch:
            res = run_batch(model, b, args.steps, args.rounds)
            report["stand_in"].append(res)
            print(
                f"decode B={b} (ms per step; d: the stand-in's set time, device: the time its "
                "forwards took in the overlapped engine):"
            )
            print(
                "  cpu   | d     | device | cpu+device | off    | on     | max(cpu,dev) | on/max "
                "| off/(cpu+dev)"
            )
            for r in res["rows"]:
                print(
                    f"  {r['cpu_ms']:5.2f} | {r['device_ms']:5.2f} | {r['device_taken_ms']:6.2f} | "
                    f"{r['sum_ms']:10.2f} | {r['off_ms']:6.2f} | {r['on_ms']:6.2f} | "
                    f"{r['max_ms']:12.2f} | {r['on_over_max']:.3f}  | {r['off_over_sum']:.3f}"
                )
    finally:
        onednn.USE_ONEDNN = with_plain
        torch.set_num_threads(threads)
    if args.real_batch:
        real = run_real(args.real_batch, args.steps, args.rounds)
        report["real"] = real
        print(
            f"radixkv-tiny decode B={real['batch']} (real CPU forward, {threads} threads): "
            f"off {real['off_ms']:.2f} ms/step, on {real['on_ms']:.2f} ms/step"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
