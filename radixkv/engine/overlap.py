"""Overlap: the host schedules and prepares step N+1 while the device runs step N.

A step's forward runs on a :class:`DeviceWorker`, one thread that executes launched steps
strictly in launch order (as a CUDA stream does): step N+1's forward starts only after step
N's has finished, so everything a forward writes (K/V pages) is in place for every later one,
whatever the host did to its bookkeeping meanwhile. The engine's ``step()`` then reads:

    schedule N+1 -> launch N+1 (build its inputs here; plan attention, forward and pick its
    tokens on the worker) -> process N (wait for its tokens, publish its pages, accept its
    tokens: stops, outputs) -> return the outputs

so outputs come one call late, and the host's work hides behind the forward: a step costs
about max(host, device) instead of their sum (bench/bench_overlap.py measures it).

The lag's rules (Engine._launch / Engine._process_launched):

* At launch, a row that samples a token gets a pending token (``Sequence.num_pending``): its
  sequence counts one token more than ``token_ids`` holds, the scheduler decodes it in the
  next step, whose input for that row is 0 on the host and is filled in on the device from
  this step's sampled ids (``index_copy`` just before the forward). The tokens with K/V
  (``token_ids[:num_computed]`` at the time the step is scheduled) are always known.
* A token that is its sequence's last possible one (``max_tokens``, which intake keeps within
  the context) gets no pending token: the sequence is not scheduled until it is processed.
* Publishing a step's full pages to the cache (``Scheduler.publish``) and releasing a sequence
  that finishes happen when the step is processed, against the tokens that step computed
  (never pages a forward still in flight writes). A sequence that ends while it is in the next
  step in flight has that row's result discarded. Pages it held may be handed out again at
  once: only later forwards write them.
* Preemption is never done while a step is in flight (``Scheduler.hold_preemption``): the
  engine processes the step in flight first and schedules again.
* Only steps whose sampling is self-contained on the device overlap: greedy and temperature /
  top-p / top-k / min-p / seeded sampling. While any live request wants logprobs, prompt
  logprobs, logit adjustments (penalties, logit bias, min_tokens), guided decoding or beam
  search, or the engine has speculative decoding, a host or storage KV tier (copies read
  pages outside the device's order) or hybrid window KV, steps run the sequential way.
* A forward that raises surfaces when its step is processed: that step's requests end with
  "error" as in a sequential step; rows of the following step whose sequences failed are void.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from radixkv.attention.base import AttentionBackend
from radixkv.engine.params import SamplingParams
from radixkv.engine.sampler import UniformStream, sample
from radixkv.model.runner import ModelRunner, PreparedStep

if TYPE_CHECKING:
    from radixkv.engine.request import RequestGroup
    from radixkv.engine.request import Sequence as Seq
    from radixkv.engine.scheduler import ScheduledBatch


def overlappable(group: RequestGroup) -> bool:
    """Whether a request's steps may overlap: nothing in its token choice reads the host's
    view of its latest tokens or wants more of the logits than the sampled id."""
    p = group.params
    return (
        not p.adjusts_logits
        and p.guided is None
        and p.logprobs is None
        and p.prompt_logprobs is None
        and not p.logprob_token_ids
        and not p.beam_width
    )


# The interpreter's switch interval while a device worker runs. The worker's few GIL-holding
# moments (waking from the device, a gather, the result) come while the host thread runs
# Python, and a thread that wants the GIL waits up to the switch interval (default 5 ms) for
# the holder to drop it: measured on the stand-in at B=256, one in three steps lost 1.5-3.5 ms
# that way. 0.2 ms bounds each wait; the host thread's own cost of more frequent switch
# checks was not measurable. Process-wide: set by the first worker that starts (only
# lowered), restored when the last one closes (unless someone changed it meanwhile).
SWITCH_INTERVAL = 2e-4
_switch_lock = threading.Lock()
_switch_users = 0
_switch_saved: float | None = None


def _hold_switch_interval() -> None:
    global _switch_users, _switch_saved
    with _switch_lock:
        if _switch_users == 0 and sys.getswitchinterval() > SWITCH_INTERVAL:
            _switch_saved = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_INTERVAL)
        _switch_users += 1


def _release_switch_interval() -> None:
    global _switch_users, _switch_saved
    with _switch_lock:
        _switch_users -= 1
        if _switch_users == 0 and _switch_saved is not None:
            if abs(sys.getswitchinterval() - SWITCH_INTERVAL) < 1e-7:  # (kept in whole us)
                sys.setswitchinterval(_switch_saved)
            _switch_saved = None


class Selection(NamedTuple):
    """How the worker picks a launched step's tokens: the argmax of every row, except the
    ``rows`` that sample (temperature > 0) with their ``params`` and ``generators``."""

    rows: list[int]
    params: list[SamplingParams]
    generators: list[UniformStream | None]


class StepResult(NamedTuple):
    """A finished forward's sampled ids: ``tokens [B]`` on the device (the next step's inputs
    are filled from it), ``host`` their copy on the CPU, ready once ``ready`` (a CUDA event;
    None on a CPU) has completed."""

    tokens: torch.Tensor
    host: torch.Tensor
    ready: torch.cuda.Event | None


@dataclass(slots=True, eq=False)
class LaunchedStep:
    """A step handed to the device: its batch, the batch rows that sample, the row of each
    sequence given a pending token (``Sequence.num_pending``), each row's ``num_computed``
    once this step is done, its plan slot and the worker's future result."""

    batch: ScheduledBatch
    rows: list[int]
    row_of: dict[Seq, int]
    upto: list[int]
    slot: int  # the runner's plan slot its attention plan is in (ModelRunner.plan)
    future: Future[StepResult] = field(repr=False)

    def tokens(self) -> list[int]:
        """The sampled id of each batch row, waiting for the forward; raises what it raised."""
        result = self.future.result()
        if result.ready is not None:
            result.ready.synchronize()
        return result.host.tolist()


class DeviceWorker:
    """One thread that runs launched steps' device work in launch order: place the inputs
    (tensors, LoRA rows), fill in tokens the previous step sampled, run the forward over the
    attention backend the host planned (in a plan slot of its own: the step in flight keeps
    the other) and pick the tokens."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._pool: ThreadPoolExecutor | None = None  # started at the first launch

    def launch(
        self,
        step: PreparedStep,
        attn: AttentionBackend,
        fill: tuple[list[int], list[int]],
        prev: LaunchedStep | None,
        selection: Selection,
    ) -> Future[StepResult]:
        """Queue ``step`` (``attn``: planned for it); ``fill`` = (positions in its flat ids,
        rows of ``prev``'s sampled ids) to copy in first."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="radixkv-device")
            _hold_switch_interval()
        before = None if prev is None else prev.future
        dst, src = fill
        # Every torch call on the worker gives the GIL up and waits to get it back while this
        # thread runs Python (up to the interpreter's switch interval each: measured 2-4 ms a
        # step at B=256): the step's tensors and indices are made here, so the worker's own
        # calls before the forward are one or two (the fill), and the argmax after it.
        runner = self.runner
        dev = runner.device
        ids_t, pos_t = runner.tensors(step)
        last = runner.last_rows(step)
        index: tuple[torch.Tensor, torch.Tensor | None] | None = None
        if dst and before is not None:
            src_t = torch.tensor(src, dtype=torch.int64, device=dev)
            # every input pending, in row order (a decode step): one gather into ids_t
            whole = len(dst) == len(step.ids) and dst[-1] == len(dst) - 1
            dst_t = None if whole else torch.tensor(dst, dtype=torch.int64, device=dev)
            index = (src_t, dst_t)
        job = (step, attn, ids_t, pos_t, last, index)
        return self._pool.submit(self._run, job, before, selection)

    def _run(
        self,
        job: tuple[
            PreparedStep,
            AttentionBackend,
            torch.Tensor,
            torch.Tensor,
            torch.Tensor,
            tuple[torch.Tensor, torch.Tensor | None] | None,
        ],
        prev: Future[StepResult] | None,
        selection: Selection,
    ) -> StepResult:
        step, attn, ids_t, pos_t, last, index = job
        runner = self.runner
        dev = runner.device
        with torch.inference_mode():
            runner.set_lora_rows(step)
            # (in launch order, prev is done; if it raised, its rows here are void anyway)
            if index is not None and prev is not None and prev.exception() is None:
                src_t, dst_t = index
                sampled = prev.result().tokens
                if dst_t is None:
                    torch.index_select(sampled, 0, src_t, out=ids_t)
                else:
                    ids_t.index_copy_(0, dst_t, sampled.index_select(0, src_t))
            logits = runner.forward_placed(step, ids_t, pos_t, attn, last)
            if dev.type == "cpu" and logits.dtype == torch.float32:
                # NumPy's argmax (torch's ties and NaN: sampler.argmax_rows): torch's would
                # wake an OpenMP team for this thread and give up the GIL (0.3 ms at B=256)
                tokens = torch.from_numpy(logits.numpy().argmax(axis=-1))
            else:
                tokens = logits.argmax(dim=-1)
            if selection.rows:
                idx = torch.tensor(selection.rows, dtype=torch.int64, device=dev)
                drawn = sample(logits.index_select(0, idx), selection.params, selection.generators)
                tokens.index_copy_(0, idx, torch.tensor(drawn, dtype=torch.int64, device=dev))
            if dev.type == "cuda":
                host = tokens.to("cpu", non_blocking=True)
                ready = torch.cuda.Event()
                ready.record()
                return StepResult(tokens, host, ready)
            return StepResult(tokens, tokens, None)

    def close(self) -> None:
        """Stop the thread (after the steps queued). Idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
            _release_switch_interval()


def fill_positions(batch: ScheduledBatch, prev: LaunchedStep | None) -> tuple[list[int], list[int]]:
    """For each row of ``batch`` whose input is a pending token: its position in the flat ids
    and its row in ``prev`` (the step that sampled it)."""
    dst: list[int] = []
    src: list[int] = []
    if prev is None:
        return dst, src
    row_of = prev.row_of
    at = 0
    for seq, n in zip(batch.seqs, batch.num_new):
        if seq.num_pending:  # (a decode row: its one new token is the pending one)
            dst.append(at + n - 1)
            src.append(row_of[seq])
        at += n
    return dst, src


def select_tokens(batch: ScheduledBatch, rows: Sequence[int]) -> Selection:
    """The worker's token choice for the sampling ``rows`` of ``batch``."""
    srows: list[int] = []
    params: list[SamplingParams] = []
    gens: list[UniformStream | None] = []
    seqs = batch.seqs
    for i in rows:
        seq = seqs[i]
        p = seq.params
        if p.temperature > 0.0:
            srows.append(i)
            params.append(p)
            gens.append(seq.generator)
    return Selection(srows, params, gens)
