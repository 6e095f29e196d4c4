"""The description of one cascade decode step: which query rows read which KV pages, level by level.

A :class:`CascadePlan` is a list of :class:`CascadeLevel` s in FlashInfer's CSR form (the same
arrays ``MultiLevelCascadeAttentionWrapper.plan`` takes), so the torch and FlashInfer cascade
implementations run the same plan. The engine's planner (engine/cascade_planner.py) builds plans
from the trie; :mod:`radixkv.attention.cascade` runs them in PyTorch. Plans are immutable and
validated on construction (every row covered exactly once per level, indptrs monotone, last-page
lengths in range), but for the planner's per-request levels (:meth:`CascadeLevel.unchecked`),
which are checked only under the debug checks.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass

from radixkv.pages import pages_for

__all__ = ["CascadeLevel", "CascadePlan"]


def _check_indptr(name: str, indptr: Sequence[int]) -> None:
    if len(indptr) < 1 or indptr[0] != 0:
        raise ValueError(f"{name} must start at 0, got {list(indptr[:3])}...")
    if any(map(operator.lt, itertools.islice(indptr, 1, None), indptr)):  # C speed; then find it
        for a, b in itertools.pairwise(indptr):
            if b < a:
                raise ValueError(f"{name} must be non-decreasing, got {a} then {b}")


@dataclass(frozen=True)
class CascadeLevel:
    """One level of a cascade plan, in FlashInfer's paged-KV format.

    Segment i covers query rows ``qo_indptr[i]:qo_indptr[i+1]`` (at least one row) and KV pages
    ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``, of which the last holds ``kv_last_page_len[i]``
    tokens (1..page_size; 0 exactly when the segment has no pages: those rows read nothing at
    this level). Segments are in row order; rows not covered by any segment read nothing.
    """

    qo_indptr: tuple[int, ...]
    kv_indptr: tuple[int, ...]
    kv_indices: tuple[int, ...]
    kv_last_page_len: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"):
            object.__setattr__(self, name, tuple(map(int, getattr(self, name))))  # C speed
        _check_indptr("qo_indptr", self.qo_indptr)
        _check_indptr("kv_indptr", self.kv_indptr)
        n = len(self.qo_indptr) - 1
        if len(self.kv_indptr) != n + 1 or len(self.kv_last_page_len) != n:
            raise ValueError(
                f"CascadeLevel: {n} segments in qo_indptr but kv_indptr has "
                f"{len(self.kv_indptr)} entries and kv_last_page_len {len(self.kv_last_page_len)}"
            )
        if self.kv_indptr[-1] != len(self.kv_indices):
            raise ValueError(
                f"kv_indptr ends at {self.kv_indptr[-1]} but there are {len(self.kv_indices)} pages"
            )
        qo, kv, last = self.qo_indptr, self.kv_indptr, self.kv_last_page_len
        # the per-segment checks below run at C speed (map over operator), a loop finds the
        # culprit only when one fails: a decode step builds a level of one segment per row
        empties = map(operator.eq, itertools.islice(kv, 1, None), kv)
        if any(map(operator.eq, itertools.islice(qo, 1, None), qo)) or any(
            map(operator.ne, empties, map(operator.not_, last))
        ):
            for i in range(n):
                if qo[i + 1] == qo[i]:
                    raise ValueError(f"segment {i} has no query rows")
                if (kv[i + 1] == kv[i]) != (last[i] == 0):
                    raise ValueError(
                        f"segment {i}: kv_last_page_len must be 0 exactly when it has no pages"
                    )
        if self.kv_indices and min(self.kv_indices) < 0:
            raise ValueError("kv_indices must be non-negative page ids")

    @classmethod
    def unchecked(
        cls,
        qo_indptr: tuple[int, ...],
        kv_indptr: tuple[int, ...],
        kv_indices: tuple[int, ...],
        kv_last_page_len: tuple[int, ...],
    ) -> CascadeLevel:
        """A level from tuples of plain ints its maker guarantees valid, without the checks
        (the engine's planner builds one per decode step from page tables it owns, and runs
        the checks under RADIXKV_DEBUG_CHECKS instead: radixkv/debug.py)."""
        lvl = object.__new__(cls)
        object.__setattr__(lvl, "qo_indptr", qo_indptr)
        object.__setattr__(lvl, "kv_indptr", kv_indptr)
        object.__setattr__(lvl, "kv_indices", kv_indices)
        object.__setattr__(lvl, "kv_last_page_len", kv_last_page_len)
        return lvl

    @classmethod
    def from_segments(
        cls, page_size: int, segments: Sequence[tuple[int, Sequence[int], int]]
    ) -> CascadeLevel:
        """A level from ``(num_rows, pages, kv_len)`` segments in row order (``kv_len`` 0: the
        rows read nothing here). ValueError when a segment's pages do not hold its ``kv_len``."""
        qo, kv, idx, last = [0], [0], [], []
        for rows, pages, kv_len in segments:
            if len(pages) != pages_for(kv_len, page_size):
                raise ValueError(
                    f"CascadeLevel.from_segments: {kv_len} tokens need "
                    f"{pages_for(kv_len, page_size)} pages of {page_size}, got {len(pages)}"
                )
            qo.append(qo[-1] + rows)
            idx.extend(pages)
            kv.append(len(idx))
            last.append(0 if kv_len == 0 else kv_len - (len(pages) - 1) * page_size)
        return cls(tuple(qo), tuple(kv), tuple(idx), tuple(last))

    @property
    def num_segments(self) -> int:
        return len(self.qo_indptr) - 1

    def segment_kv_len(self, i: int, page_size: int) -> int:
        """Number of KV tokens segment ``i`` reads."""
        n_pages = self.kv_indptr[i + 1] - self.kv_indptr[i]
        return 0 if n_pages == 0 else (n_pages - 1) * page_size + self.kv_last_page_len[i]

    def kv_tokens_read(self, page_size: int) -> int:
        """KV tokens read at this level (each segment's KV read once)."""
        # each non-empty segment reads its pages but the last whole, then kv_last_page_len
        # (0 exactly for the empty ones)
        last = self.kv_last_page_len
        nonempty = len(last) - last.count(0)
        return (self.kv_indptr[-1] - nonempty) * page_size + sum(last)


@dataclass(frozen=True)
class CascadePlan:
    """Multi-level decode plan for ``num_queries`` rows (one decode token per request)."""

    page_size: int
    num_queries: int
    levels: tuple[CascadeLevel, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "levels", tuple(self.levels))
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if not self.levels:
            raise ValueError("a CascadePlan needs at least one level")
        covered = [False] * self.num_queries
        whole = False  # a level whose segments cover every row with KV (a decode plan's last)
        for li, lvl in enumerate(self.levels):
            if lvl.qo_indptr[-1] > self.num_queries:
                raise ValueError(
                    f"level {li} covers rows up to {lvl.qo_indptr[-1]} > num_queries "
                    f"{self.num_queries}"
                )
            if max(lvl.kv_last_page_len, default=0) > self.page_size:
                raise ValueError(f"level {li}: kv_last_page_len above page_size")
            qo = lvl.qo_indptr
            if qo[-1] == self.num_queries and 0 not in lvl.kv_last_page_len:
                whole = True
                continue
            for i, last in enumerate(lvl.kv_last_page_len):
                if last > 0:
                    covered[qo[i] : qo[i + 1]] = [True] * (qo[i + 1] - qo[i])
        missing = [] if whole else [r for r, c in enumerate(covered) if not c]
        if missing:
            raise ValueError(f"query rows {missing[:8]} read no KV at any level")

    @classmethod
    def plain(
        cls, page_tables: Sequence[Sequence[int]], seq_lens: Sequence[int], page_size: int
    ) -> CascadePlan:
        """The one-level plan of ordinary paged decode: every request reads all its pages."""
        if len(page_tables) != len(seq_lens):
            raise ValueError("page_tables and seq_lens differ in length")
        kv_indptr, kv_indices, last = [0], [], []
        for pt, n in zip(page_tables, seq_lens):
            n_pages = pages_for(n, page_size)
            if n < 1 or len(pt) < n_pages:
                raise ValueError(f"seq_len {n} needs {n_pages} pages, page table has {len(pt)}")
            kv_indices.extend(pt[:n_pages])
            kv_indptr.append(len(kv_indices))
            last.append(n - (n_pages - 1) * page_size)
        level = CascadeLevel(tuple(range(len(seq_lens) + 1)), kv_indptr, kv_indices, last)
        return cls(page_size, len(seq_lens), (level,))

    def kv_tokens_read(self) -> int:
        return sum(lvl.kv_tokens_read(self.page_size) for lvl in self.levels)
