"""ModelRunner: one forward step of a batch of sequences over the paged KV pool.

The runner never allocates or frees pages: the engine passes each sequence's page table in.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np
import torch

from radixkv.attention.base import AttentionBackend, BatchLayout
from radixkv.attention.cascade_backend import CascadeDecodeBackend
from radixkv.attention.hybrid import HybridAttention
from radixkv.attention.page_table_rows import PageTableRows
from radixkv.attention.registry import get_backend
from radixkv.attention.torch_backend import TorchAttention
from radixkv.debug import debug_checks_enabled
from radixkv.kv.hybrid_pool import HybridKVPool
from radixkv.kv.kv_pool import KVPool
from radixkv.model.causal_lm import CausalLM
from radixkv.model.cpu_malloc import keep_freed_memory
from radixkv.model.linear import pack_linears
from radixkv.model.lora import LoRASet

if TYPE_CHECKING:
    from radixkv.attention.cascade_plan import CascadePlan


_first = operator.itemgetter(0)  # a SeqInput's new_token_ids; a list's first item


class CascadeSchedule(Protocol):
    """A decode step's cascade plan and its row order (the engine's ``CascadeDecision``)."""

    @property
    def plan(self) -> CascadePlan: ...

    @property
    def order(self) -> Sequence[int]: ...


class SeqInput(NamedTuple):
    """One sequence of a step (a NamedTuple: the engine builds one per sequence per step).

    ``page_table`` covers all ``num_past + len(new_token_ids)`` tokens: token ``i`` lives at
    ``(page_table[i // page_size], i % page_size)``. The first ``num_past`` tokens' K/V are already
    in the pool; the new tokens get positions ``num_past ..`` and their K/V are written.
    ``lora_slot``: the LoRA adapter its tokens run with (a slot of the runner's ``loras``;
    0: the base model).
    """

    new_token_ids: Sequence[int]
    page_table: Sequence[int]
    num_past: int = 0
    lora_slot: int = 0


class PreparedStep(NamedTuple):
    """A forward's inputs built on the host (:meth:`ModelRunner.build`): the attention layout,
    the flat token ids and positions, the largest position, tokens per sequence, each
    sequence's LoRA slot (None: no adapter is loaded) and the cascade schedule, if any."""

    layout: BatchLayout
    ids: list[int]
    positions: list[int]
    max_position: int
    num_new: list[int]
    lora_slots: list[int] | None
    cascade: CascadeSchedule | None
    cascade_rows: Sequence[int] | None


class ModelRunner:
    """Runs ``model`` on batches of :class:`SeqInput` with ``kv_pool`` as its KV cache.

    ``forward`` mutates the pool: every layer's K/V of every new token is written to the slots
    given by its page table. Nothing else is mutated. The engine checks prompts once, at intake,
    and builds the page tables itself, so per-step input checks are debug-only: with
    ``check_inputs`` (default: ``RADIXKV_DEBUG_CHECKS``, see radixkv/debug.py) a bad batch
    (token ids outside the vocabulary, past the context, short or out-of-range page tables)
    raises ValueError before any write and leaves the pool untouched.
    """

    def __init__(
        self,
        model: CausalLM,
        kv_pool: KVPool | HybridKVPool,
        backend: str = "auto",
        *,
        check_inputs: bool | None = None,
    ) -> None:
        cfg = model.config
        problems = []
        if kv_pool.num_layers != cfg.num_layers:
            problems.append(f"num_layers {kv_pool.num_layers} != model's {cfg.num_layers}")
        if kv_pool.num_kv_heads != cfg.num_kv_heads:
            problems.append(f"num_kv_heads {kv_pool.num_kv_heads} != model's {cfg.num_kv_heads}")
        if kv_pool.head_dim != cfg.head_dim:
            problems.append(f"head_dim {kv_pool.head_dim} != model's {cfg.head_dim}")
        if kv_pool.compute_dtype != model.dtype:  # its pages may store another (kv_cache_dtype)
            problems.append(f"compute dtype {kv_pool.compute_dtype} != model's {model.dtype}")
        if kv_pool.device != model.device:
            problems.append(f"device {kv_pool.device} != model's {model.device}")
        if problems:
            raise ValueError("KV pool does not fit the model: " + "; ".join(problems))
        # bytes of linear weights with a packed copy for oneDNN (radixkv/onednn.py): packed
        # now, not in the first request's forward; the copies take about as much again
        self.packed_weight_bytes = 0
        if kv_pool.device.type == "cpu":
            keep_freed_memory()  # activations reuse heap pages instead of faulting new ones
            self.packed_weight_bytes = pack_linears(model)
        self.model = model
        self.config = cfg
        self.kv_pool = kv_pool
        self.device = kv_pool.device
        self._backend = backend
        self.check_inputs = debug_checks_enabled() if check_inputs is None else check_inputs
        self.attn: AttentionBackend = self._new_backend()
        # the page tables of the last steps as array rows, converted again only where they
        # changed (a persistent batch: radixkv/attention/page_table_rows.py); built on the
        # host thread only (not thread-safe), shared by the plan slots
        self._page_rows = PageTableRows(check=self.check_inputs)
        # created on the first cascade step: the backend a cascade step runs, and the cascade
        # backend in it (the same object, or with hybrid window KV its full layers' part)
        self._cascade: AttentionBackend | None = None
        self._cascade_inner: CascadeDecodeBackend | None = None
        # plan slots past 0 (:meth:`plan`): another runner's worth of attention backends each
        self._spares: list[ModelRunner] = []
        # LoRA adapters attached to the model (radixkv/model/lora.py); SeqInput.lora_slot
        # picks one per sequence
        self.loras = LoRASet.of(model)  # shared by the runners of one model

    def _new_backend(self) -> AttentionBackend:
        cfg = self.config
        attn = get_backend(
            self._backend,
            self.kv_pool,
            num_qo_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            scale=cfg.attention_multiplier,  # None: 1/sqrt(head_dim); Granite's own
            layer_windows=cfg.layer_windows,  # sliding windows (Mistral, Gemma 2/3, ...)
            softcap=cfg.attn_logit_softcapping,  # Gemma 2's; None elsewhere
        )
        attn.check_layouts = self.check_inputs  # the backend validates each layout
        return attn

    @property
    def backend_name(self) -> str:
        return self.attn.name

    def _check_inputs(self, seqs: Sequence[SeqInput]) -> None:
        """Debug check of a batch (the engine's batches pass by construction)."""
        vocab, max_ctx = self.config.vocab_size, self.config.max_position_embeddings
        for i, s in enumerate(seqs):
            if not isinstance(s, SeqInput):
                raise TypeError(f"sequence {i}: expected SeqInput, got {type(s).__name__}")
            if not len(s.new_token_ids):  # (before build reads its last position)
                raise ValueError(f"sequence {i}: needs at least one new token, got 0")
            for t in s.new_token_ids:
                if not 0 <= t < vocab:
                    raise ValueError(f"sequence {i}: token id {t} out of range [0, {vocab})")
            if s.lora_slot and s.lora_slot not in self.loras.adapters:
                raise ValueError(f"sequence {i}: no LoRA adapter in slot {s.lora_slot}")
            end = s.num_past + len(s.new_token_ids)
            if end > max_ctx:
                raise ValueError(
                    f"sequence {i}: {end} tokens exceed the model's context of {max_ctx}"
                )

    @torch.inference_mode()
    def forward(
        self,
        seqs: Sequence[SeqInput],
        *,
        all_logits: bool = False,
        cascade: CascadeSchedule | None = None,
        cascade_rows: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """fp32 logits ``[len(seqs), vocab]`` of each sequence's last new token, or with
        ``all_logits=True`` ``[sum of new tokens, vocab]`` for every new token in batch order.

        ``cascade``: a ``CascadeDecision`` from
        :class:`radixkv.engine.cascade_planner.CascadePlanner` over the decode sequences
        ``cascade_rows`` (batch indices, in the planner's input order; None: the whole batch,
        which must then be decode-only): their shared prefixes are read once per group (same
        logits, fewer KV reads). A plan over part of a batch needs ``supports_mixed_cascade``."""
        ids_t, pos_t, max_pos, attn = self._prepare(seqs, cascade, cascade_rows)
        idx_t = None if all_logits else self._last_rows(list(map(len, map(_first, seqs))))
        return self.model(ids_t, pos_t, attn, idx_t, max_position=max_pos)

    @torch.inference_mode()
    def forward_hidden(
        self,
        seqs: Sequence[SeqInput],
        hidden_of: Sequence[int],
        *,
        cascade: CascadeSchedule | None = None,
        cascade_rows: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``forward``'s last-token logits ``[len(seqs), vocab]``, and for each batch index in
        ``hidden_of`` the trunk hidden states ``[len(new_token_ids), hidden]`` of all that
        sequence's new tokens, for :meth:`logits` to turn into logits a block at a time
        (prompt logprobs need every position, and ``[T, vocab]`` at once can be gigabytes)."""
        ids_t, pos_t, max_pos, attn = self._prepare(seqs, cascade, cascade_rows)
        h = self.model.trunk(ids_t, pos_t, attn, max_position=max_pos)  # [T, hidden]
        logits = self.model.head(
            h.index_select(0, self._last_rows(list(map(len, map(_first, seqs)))))
        )
        starts = [0]
        for s in seqs:
            starts.append(starts[-1] + len(s.new_token_ids))
        return logits, [h[starts[i] : starts[i + 1]] for i in hidden_of]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[R, vocab]`` of trunk hidden states ``[R, hidden]`` (forward_hidden's)."""
        return self.model.head(hidden)

    def _prepare(
        self,
        seqs: Sequence[SeqInput],
        cascade: CascadeSchedule | None,
        cascade_rows: Sequence[int] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, int, AttentionBackend]:
        """Token ids and positions ``[T]`` on the device, the largest position, and the
        attention backend planned for the batch (:meth:`build` then :meth:`place`)."""
        step = self.build(seqs, cascade, cascade_rows)
        ids_t, pos_t, attn = self.place(step)
        return ids_t, pos_t, step.max_position, attn

    def build(
        self,
        seqs: Sequence[SeqInput],
        cascade: CascadeSchedule | None = None,
        cascade_rows: Sequence[int] | None = None,
    ) -> PreparedStep:
        """The pure-data half of a forward's preparation (no device work, no backend state
        touched): the batch layout, flat token ids and positions. The engine's overlap
        (engine/overlap.py) builds step N+1 this way while step N's forward runs, and
        :meth:`place` it on the device thread just before its forward."""
        if not seqs:
            raise ValueError("ModelRunner.forward: empty batch")
        if self.check_inputs:
            self._check_inputs(seqs)
        # the batch column by column (SeqInput's fields), at C speed
        new_ids, tables, pasts, _ = zip(*seqs, strict=True)
        num_new = list(map(len, new_ids))
        positions = list(pasts)
        # a cascade over the whole batch reads only the write slots of the layout: no arrays
        whole_cascade = cascade is not None and cascade_rows is None
        rows = None if whole_cascade else self._page_rows
        layout = BatchLayout.build(tables, positions, num_new, rows=rows)
        if len(num_new) == sum(num_new):  # decode: one token each, at its past length
            ids = list(map(int, map(_first, new_ids)))
        else:
            ids, positions = [], []
            for s in seqs:
                ids.extend(map(int, s.new_token_ids))
                positions.extend(range(s.num_past, s.num_past + len(s.new_token_ids)))
        lora_slots = [s.lora_slot for s in seqs] if self.loras.adapters else None
        return PreparedStep(
            layout, ids, positions, max(positions), num_new, lora_slots, cascade, cascade_rows
        )

    def place(self, step: PreparedStep) -> tuple[torch.Tensor, torch.Tensor, AttentionBackend]:
        """The device half: :meth:`inputs` and :meth:`plan` (slot 0)."""
        ids_t, pos_t = self.inputs(step)
        return ids_t, pos_t, self.plan(step)

    def inputs(self, step: PreparedStep) -> tuple[torch.Tensor, torch.Tensor]:
        """``step``'s token ids and positions as tensors on the device (:meth:`tensors`), with
        the model's LoRA rows set for it (:meth:`set_lora_rows`)."""
        ids_t, pos_t = self.tensors(step)
        self.set_lora_rows(step)
        return ids_t, pos_t

    def tensors(self, step: PreparedStep) -> tuple[torch.Tensor, torch.Tensor]:
        """``step``'s token ids and positions ``[T]`` as new tensors on the device (no model
        state: any thread, any time before the forward)."""
        dev = self.device
        # through numpy: torch.tensor on a list of Python ints costs several times more
        ids_t = torch.from_numpy(np.array(step.ids, dtype=np.int64)).to(dev, non_blocking=True)
        pos_t = torch.from_numpy(np.array(step.positions, dtype=np.int64)).to(
            dev, non_blocking=True
        )
        return ids_t, pos_t

    def set_lora_rows(self, step: PreparedStep) -> None:
        """Set the model's LoRA rows for ``step`` (model state: call it in forward order,
        just before the forward; nothing to do when no adapter is loaded)."""
        if step.lora_slots is not None:
            self.loras.set_rows(step.lora_slots, step.layout.num_new, self.device)

    def plan(self, step: PreparedStep, slot: int = 0) -> AttentionBackend:
        """The attention backend of plan slot ``slot`` planned for ``step``. A backend holds
        its plan until the next one, so a slot must not be planned again before the forward
        that reads it has run; with two slots, the engine's overlap (engine/overlap.py) plans
        step N+1 here while step N's forward runs on the other."""
        if slot:
            while len(self._spares) < slot:
                spare = object.__new__(ModelRunner)  # the same runner, its own backends
                spare.__dict__.update(self.__dict__)
                spare.attn = self._new_backend()
                spare._cascade = spare._cascade_inner = None
                spare._spares = []
                self._spares.append(spare)
            return self._spares[slot - 1].plan(step)
        cascade = step.cascade
        attn = self.attn if cascade is None else self._cascade_attn(cascade, step.cascade_rows)
        attn.plan(step.layout)
        return attn

    @torch.inference_mode()
    def forward_placed(
        self,
        step: PreparedStep,
        ids_t: torch.Tensor,
        pos_t: torch.Tensor,
        attn: AttentionBackend,
        last_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`forward` of a step already built and placed (``ids_t`` may have been
        completed on the device since: engine/overlap.py fills in tokens sampled by the
        previous step): the last-token logits ``[len(seqs), vocab]``. ``last_rows``:
        :meth:`last_rows` of the step, if made already."""
        idx_t = self.last_rows(step) if last_rows is None else last_rows
        return self.model(ids_t, pos_t, attn, idx_t, max_position=step.max_position)

    def last_rows(self, step: PreparedStep) -> torch.Tensor:
        """Row of each sequence's last new token in ``step``'s flattened batch ``[B]``."""
        return self._last_rows(step.num_new)

    def _last_rows(self, num_new: Sequence[int]) -> torch.Tensor:
        """Row of each sequence's last new token in the flattened batch ``[len(num_new)]``."""
        if sum(num_new) == len(num_new):  # one token each
            return torch.arange(len(num_new), device=self.device)
        last: list[int] = []
        end = -1
        for n in num_new:
            end += n
            last.append(end)
        return torch.tensor(last, dtype=torch.int64).to(self.device)

    @property
    def _cascaded(self) -> AttentionBackend | None:
        """The backend a cascade wraps: the full layers' one with hybrid window KV (the
        windowed layers read their windows alone; None: every layer is windowed)."""
        return self.attn.full if isinstance(self.attn, HybridAttention) else self.attn

    @property
    def supports_cascade(self) -> bool:
        """Whether cascade decode can run this model (its kernels do not soft-cap scores, so
        not Gemma 2; with hybrid window KV, only when some layer attends in full)."""
        return self.attn.softcap is None and self._cascaded is not None

    @property
    def supports_mixed_cascade(self) -> bool:
        """Whether a cascade plan may cover just the decode sequences of a mixed batch (the
        torch backend; FlashInfer's cascade runs decode-only steps)."""
        return isinstance(self._cascaded, TorchAttention)

    def _cascade_attn(
        self, decision: CascadeSchedule, rows: Sequence[int] | None
    ) -> AttentionBackend:
        if self._cascade is None:
            inner = self._cascaded
            assert inner is not None  # the engine asks supports_cascade first
            self._cascade_inner = CascadeDecodeBackend(inner)
            self._cascade_inner.check_layouts = self.check_inputs
            self._cascade = (
                self.attn.with_full(self._cascade_inner)
                if isinstance(self.attn, HybridAttention)
                else self._cascade_inner
            )
        self._cascade_inner.set_plan(decision.plan, decision.order, rows)
        return self._cascade
