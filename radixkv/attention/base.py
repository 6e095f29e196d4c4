"""The attention backend interface shared by the torch and flashinfer implementations.

One forward step of the model is a *batch* of sequences laid out ragged: the new tokens of
sequence 0, then those of sequence 1, ... (``T = sum(num_new)`` tokens in all). Per step the runner
calls :meth:`AttentionBackend.plan` once; then, per layer, the model calls
:meth:`AttentionBackend.forward`, which writes the new K/V into their page slots and attends.

The engine builds every layout from page tables it owns, so a backend re-checks one
(:meth:`BatchLayout.validate`) only when ``check_layouts`` is on: in debug runs and tests
(radixkv/debug.py), or when a caller sets it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from radixkv.attention.page_table_rows import PageTableRows, pad_rows
from radixkv.debug import debug_checks_enabled
from radixkv.kv.kv_pool import KVPool
from radixkv.pages import pages_for

# Batches of fewer sequences build their layout without the caller's PageTableRows (the
# arrays are then made from the page tables when a plan first reads them): for a handful of
# short tables its fixed cost (a few passes and array calls) outweighs converting them anew.
ROWS_MIN_BATCH = 8


class LayoutArrays(NamedTuple):
    """A :class:`BatchLayout` as int64 arrays, for plans built by array ops instead of Python
    loops over the page tables."""

    pages: np.ndarray  # [B, W]: row i is page_tables[i], then its first page repeated (pad_rows)
    num_pages: np.ndarray  # [B] pages in each table (len(page_tables[i]))
    num_past: np.ndarray  # [B]
    num_new: np.ndarray  # [B]


@dataclass(frozen=True)
class BatchLayout:
    """What one step computes, per sequence ``i``.

    ``page_tables[i]`` covers all ``num_past[i] + num_new[i]`` tokens (at least
    ``ceil((num_past + num_new) / page_size)`` pages; extra trailing pages are ignored).
    The first ``num_past[i]`` tokens' K/V are already in the pool; the ``num_new[i]`` new tokens
    sit at positions ``num_past[i] ..`` and attend causally to every earlier token of their own
    sequence. The page tables are the layout's own (copies nobody mutates), so a plan may read
    them while the engine changes its lists for the next step.

    :attr:`arrays` holds the same as int64 arrays (made on first use, or by :meth:`build` from
    the rows a :class:`PageTableRows` keeps across steps).
    """

    page_tables: tuple[Sequence[int], ...]
    num_past: tuple[int, ...]
    num_new: tuple[int, ...]
    _arrays: LayoutArrays | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.page_tables)
        if len(self.num_past) != n or len(self.num_new) != n:
            raise ValueError("BatchLayout: page_tables, num_past and num_new differ in length")
        if n == 0:
            raise ValueError("BatchLayout: empty batch")

    @classmethod
    def build(
        cls,
        page_tables: Sequence[Sequence[int]],
        num_past: Sequence[int],
        num_new: Sequence[int],
        *,
        rows: PageTableRows | None = None,
    ) -> BatchLayout:
        """The layout of these sequences. ``rows``: the caller's :class:`PageTableRows`, which
        converts only the page tables that changed since its last step into :attr:`arrays`
        (the model runner keeps one; used from ``ROWS_MIN_BATCH`` sequences); without it the
        arrays are made when first read."""
        if rows is not None and len(page_tables) >= ROWS_MIN_BATCH:
            snaps, pages, counts = rows.gather(page_tables)
            past_a, new_a = np.array(num_past, np.int64), np.array(num_new, np.int64)
            arrays = LayoutArrays(pages, counts, past_a, new_a)
            return cls(snaps, tuple(past_a.tolist()), tuple(new_a.tolist()), arrays)
        past = tuple(map(int, num_past))
        new = tuple(map(int, num_new))
        # map(int, ...) runs at C speed and turns numpy/torch integers into plain ints; a list
        # is taken as holding ints already (the engine's page tables are lists of ints), and
        # copied as it is: a decode step of 32 sequences x 4k tokens converts 8k page ids
        return cls(
            tuple(tuple(pt) if type(pt) is list else tuple(map(int, pt)) for pt in page_tables),
            past,
            new,
        )

    @property
    def arrays(self) -> LayoutArrays:
        """The layout as int64 arrays (see :class:`LayoutArrays`); made once, on first use."""
        a = self._arrays
        if a is None:
            a = LayoutArrays(
                pad_rows(self.page_tables),
                np.array([len(t) for t in self.page_tables], np.int64),
                np.array(self.num_past, np.int64),
                np.array(self.num_new, np.int64),
            )
            object.__setattr__(self, "_arrays", a)
        return a

    def select(self, rows: Sequence[int]) -> BatchLayout:
        """The layout of sequences ``rows`` (batch indices) alone, in that order."""
        a = self._arrays
        sub = None
        if a is not None:
            idx = np.asarray(rows, dtype=np.int64)
            counts = a.num_pages[idx]
            width = max(1, int(counts.max(initial=0)))
            sub = LayoutArrays(a.pages[idx, :width], counts, a.num_past[idx], a.num_new[idx])
        return BatchLayout(
            tuple(self.page_tables[i] for i in rows),
            tuple(self.num_past[i] for i in rows),
            tuple(self.num_new[i] for i in rows),
            sub,
        )

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    @property
    def longest(self) -> int:
        """Tokens (past and new) of the batch's longest sequence."""
        return max(p + n for p, n in zip(self.num_past, self.num_new, strict=True))

    def validate(self, page_size: int, num_pages: int) -> None:
        """Raise ValueError naming the sequence if it has no new token or a page table is short
        or out of range. A debug check: backends run it when their ``check_layouts`` is on."""
        for i, (pt, past, new) in enumerate(
            zip(self.page_tables, self.num_past, self.num_new, strict=True)
        ):
            if past < 0:
                raise ValueError(f"sequence {i}: num_past must be >= 0, got {past}")
            if new <= 0:
                raise ValueError(f"sequence {i}: needs at least one new token, got {new}")
            need = pages_for(past + new, page_size)
            if len(pt) < need:
                raise ValueError(
                    f"sequence {i}: {past} past + {new} new tokens need {need} pages of "
                    f"{page_size}, page table has {len(pt)}"
                )
            used = pt[:need]
            if min(used) < 0 or max(used) >= num_pages:  # C-speed scan; find the culprit after
                bad = next(p for p in used if not 0 <= p < num_pages)
                raise ValueError(
                    f"sequence {i}: page id {bad} out of range [0, {num_pages}) of the KV pool"
                )


def check_layer_windows(layer_windows: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """``layer_windows`` as a tuple of ``num_layers`` windows (empty: all full), or ValueError
    naming the bad entry."""
    windows = tuple(layer_windows)
    if windows and len(windows) != num_layers:
        raise ValueError(f"layer_windows has {len(windows)} entries for {num_layers} layers")
    for i, w in enumerate(windows):
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"layer_windows[{i}] must be an int >= 0 (0: full), got {w!r}")
    return windows if any(windows) else ()


def outgrown_windows(layer_windows: Sequence[int], longest: int) -> tuple[int, ...]:
    """The distinct sliding windows (> 0) among ``layer_windows`` that a sequence of
    ``longest`` tokens has outgrown, smallest first: the layers with them cannot attend as if
    in full (a window no shorter than every sequence is the same computation as none)."""
    return tuple(sorted({w for w in layer_windows if w and longest > w}))


class AttentionBackend(ABC):
    """Paged attention over a :class:`KVPool`.

    Sliding windows: ``layer_windows[l] = W > 0`` makes layer ``l`` attend, from a query at
    position ``i``, only the keys at positions ``i - W + 1 .. i`` (W keys, itself included: what
    Hugging Face configs call ``sliding_window``); 0, or an empty tuple for all layers, means
    every earlier key. A backend over a plain :class:`KVPool` writes and keeps every token's
    K/V in every layer (pages are shared by layers of both kinds): there a window saves
    attention work. Hybrid window KV (radixkv/attention/hybrid.py) saves the memory too: it
    gives the windowed layers their own pool of window slots and a backend of their own.
    ``softcap`` (Gemma 2): scaled scores ``s`` become ``softcap * tanh(s / softcap)`` before
    the softmax.

    Contract: ``plan`` is called once per step, before any ``forward``; its metadata is reused by
    every layer. ``forward(layer, q, k, v)`` mutates the pool (writes the new tokens' K/V into
    their slots of layer ``layer``) and returns the attention output. Shapes (ragged token order
    of the layout): ``q [T, num_qo_heads, head_dim]``, ``k, v [T, num_kv_heads, head_dim]``,
    output ``[T, num_qo_heads, head_dim]`` in ``q``'s dtype. ``plan`` validates the layout
    (ValueError before anything is written) when ``check_layouts`` is True, which it is by
    default only in debug runs (radixkv/debug.py); the engine's layouts are valid by construction.
    """

    name: str = "base"

    def __init__(
        self,
        kv_pool: KVPool,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float | None = None,
        *,
        layer_windows: Sequence[int] = (),
        softcap: float | None = None,
    ) -> None:
        if num_qo_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if kv_pool.num_kv_heads != num_kv_heads or kv_pool.head_dim != head_dim:
            raise ValueError(
                f"KV pool has {kv_pool.num_kv_heads} kv heads x {kv_pool.head_dim} dims, "
                f"attention needs {num_kv_heads} x {head_dim}"
            )
        self.kv_pool = kv_pool
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = float(scale) if scale is not None else head_dim**-0.5
        self.layer_windows = check_layer_windows(layer_windows, kv_pool.num_layers)
        # the distinct sliding windows, smallest first (empty: every layer attends in full)
        self.windows = tuple(sorted({w for w in self.layer_windows if w}))
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be a positive number, got {softcap!r}")
        self.softcap = None if softcap is None else float(softcap)
        self.check_layouts = debug_checks_enabled()  # validate each plan()'s layout
        self._slots: torch.Tensor | None = None  # [T] flat pool slot of each new token
        self._num_tokens = 0

    def _plan_slots(self, layout: BatchLayout) -> None:
        """Record the step's write slots (ragged batch order) on the pool's device: array ops
        over the layout's :attr:`~BatchLayout.arrays` (a Python pass for a few decodes)."""
        ps = self.kv_pool.page_size
        num_tokens = layout.num_tokens
        n = len(layout.num_new)
        if num_tokens == n and (n < ROWS_MIN_BATCH or not self.has_arrays(layout)):
            # decodes without arrays (a few, or a cascade step's): a Python pass costs less
            slots = torch.tensor(
                [pt[p // ps] * ps + p % ps for pt, p in zip(layout.page_tables, layout.num_past)],
                dtype=torch.int64,
            )
            self._num_tokens = num_tokens
            self._slots = slots.to(self.kv_pool.device, non_blocking=True)
            return
        a = layout.arrays
        past, new = a.num_past, a.num_new
        if num_tokens == n:  # decode: one slot each, at its past length
            slots = a.pages[np.arange(len(new)), past // ps] * ps + past % ps
        else:  # token t of sequence i sits at position past[i] + t
            rows = np.repeat(np.arange(len(new)), new)
            pos = np.arange(num_tokens) + np.repeat(past - (np.cumsum(new) - new), new)
            slots = a.pages[rows, pos // ps] * ps + pos % ps
        self._num_tokens = num_tokens
        self._slots = torch.from_numpy(slots).to(self.kv_pool.device, non_blocking=True)

    @staticmethod
    def has_arrays(layout: BatchLayout) -> bool:
        """Whether the layout's :attr:`~BatchLayout.arrays` are made already (by
        ``BatchLayout.build`` with the runner's PageTableRows): else a plan that needs only a
        little of them reads the page tables instead of making them."""
        return layout._arrays is not None

    def _write_new_kv(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first half of every ``forward``: check the step was planned for ``q``'s tokens,
        then write the new K/V of layer ``layer`` into their slots (mutates the pool). Returns
        ``k, v`` as the pool stores them (``KVPool.as_stored``): what attention over the fresh
        tokens must read, so that it matches attention over the same tokens read back later."""
        if self._slots is None:
            raise RuntimeError(f"{type(self).__name__}.forward called before plan()")
        if q.shape[0] != self._num_tokens:
            raise ValueError(f"planned {self._num_tokens} tokens, got q with {q.shape[0]}")
        pool = self.kv_pool
        pool.write(layer, self._slots, k, v)
        return pool.as_stored(k), pool.as_stored(v)

    @abstractmethod
    def plan(self, layout: BatchLayout) -> None:
        """Prepare per-step metadata (slots to write, gather indices, masks)."""

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Write ``k``/``v`` into the pool for layer ``layer``, attend, return ``[T, Hq, D]``."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``forward`` without the write: the new tokens' K/V are in the pool already and
        ``k, v`` are them as stored (``KVPool.as_stored``). For backends that wrap others."""
        raise NotImplementedError(f"{type(self).__name__} attends only through forward()")
