"""What one forward is given: per-sequence inputs and the decode-cascade decision.

Contract: both functions read the scheduled batch and its sequences and mutate none of them.
``plan_cascade`` is the glue between a step and ``CascadePlanner``: it asks for a cascade
only when the batch is all decode, and it is where the step's decode KV traffic is counted,
so it adds to the ``EngineStats`` it is given (``kv_bytes_read_plain``,
``kv_bytes_read_cascade``, ``cascade_steps``) and to nothing else.
"""

from __future__ import annotations

from typing import Any

from radixkv.engine.cascade_planner import CascadeDecision, CascadePlanner, DecodeEntry
from radixkv.engine.outputs import EngineStats
from radixkv.engine.scheduler import ScheduledBatch


def model_inputs(batch: ScheduledBatch) -> list[Any]:
    """One ``SeqInput`` per scheduled sequence: its new tokens over its page table."""
    from radixkv.model.runner import SeqInput

    return [
        SeqInput(s.token_ids[s.num_computed : s.num_computed + n], s.page_table, s.num_computed)
        for s, n in zip(batch.seqs, batch.num_new)
    ]


def plan_cascade(
    planner: CascadePlanner, batch: ScheduledBatch, stats: EngineStats, kv_bytes_per_token: int
) -> CascadeDecision | None:
    """Count the step's decode KV reads; return a CascadeDecision when the batch is all
    decode and the planner finds sharing that pays, else None (plain paged decode)."""
    dec_seqs = [s for s, n in zip(batch.seqs, batch.num_new) if n == 1 and s.num_computed]
    plain = sum(s.num_computed + 1 for s in dec_seqs)
    read = plain
    decision = None
    if len(dec_seqs) == len(batch.seqs) > 1 and planner.mode != "off":
        entries = [
            DecodeEntry(s.locked_node, s.page_table, s.num_computed + 1, s.num_shared_pages)
            for s in dec_seqs
        ]
        d = planner.plan(entries)
        if d.use_cascade:
            decision, read = d, d.kv_tokens_cascade
            stats.cascade_steps += 1
    stats.kv_bytes_read_plain += plain * kv_bytes_per_token
    stats.kv_bytes_read_cascade += read * kv_bytes_per_token
    return decision
