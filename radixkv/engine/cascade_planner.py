"""Per-step cascade planning for decode batches, from the radix tree the running requests lock.

Each running sequence holds a lock on a trie node (its cached prefix): the pages on the path
from the root to that node are shared, read-only, with every other sequence whose path goes
through the same nodes; the rest of its page table is private (including its partial last page
and the slot of the token being decoded). The planner groups sequences by the trie nodes they
share, so that a shared prefix's KV is read once per group rather than once per sequence:

* Paths are compressed into *segments*: maximal chains of trie nodes that exactly the same
  sequences go through. A segment read by ``G >= 2`` sequences whose pages save enough reads
  (``pages * page_size * (G - 1) >= min_saved_tokens``) becomes a shared segment; nested sharing
  (a trunk, then branches of it, then branches of those) gives one level per depth.
* Sequences are ordered depth-first over the tree, so every group is a contiguous run of rows.
* The last level holds, per sequence, every page of its table not read at a shared level: its
  private pages (partial last page included) and any shared pages too small to pay.
* Mode ``"auto"`` falls back to the plain one-level plan when the whole step saves fewer than
  ``min_step_saved_tokens`` KV tokens (per layer) or ``min_step_saved_fraction`` of the plain
  reads: each extra level costs kernel calls, gathers and a merge (about 0.1 ms a layer on 2
  CPU cores), which the saved reads must outweigh. Measured with bench/bench_cascade.py on
  radixkv-tiny's head shape (128 K+V values per token and layer) on 2 CPU cores, three runs of
  each grid point around the crossover: in fp32, cascade loses at 3,840 and 4,096 saved tokens
  a step (0.80-0.84x, 0.88-0.90x) and wins from 7,168 (1.41-1.44x); in bf16 it loses at 3,840
  (0.92-0.94x) and wins from 4,096 (1.03-1.09x; 1.24-1.28x at 7,168). bf16 crosses over sooner
  because PyTorch's CPU kernels are slower per token in bf16 than in fp32 (plain decode of 32
  x 4,224 tokens: 4.3 against 2.8 ms), while the cascade's fixed cost is about the same. So the
  threshold is ``MIN_STEP_SAVED_VALUES`` K+V values per layer, by the KV's bytes per value
  (5,120 tokens here in fp32, 4,096 in bf16), which the engine turns into tokens for its model
  (:meth:`CascadePlanner.min_step_tokens_for`).
  ``"on"`` keeps every segment shared by two or more sequences; ``"off"`` always plans plain
  decode.

The planner reads the trie (``node.parent``, ``node.num_tokens``) and never mutates it or the
sequences; the caller must hold the locks for the duration of the step. Shared pages are always
whole pages of already-computed tokens, so they never overlap the step's new tokens.

Consecutive decode steps of the same sequences lock the same nodes, and a locked node's path
pages never change (a split keeps them: the node keeps its lower part under a new upper node,
which the same sequences traverse, so the compressed segments are the same). So the planner
keeps the last plan's shared levels, row order and per-row covered ranges, keyed on the
entries' nodes (by identity, held) and shared page counts, and on a hit rebuilds only the last
level (each row's private pages, which grow as it decodes): a decode step costs one pass over
the batch instead of a tree build.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple, Protocol

import numpy as np

from radixkv.attention.base import outgrown_windows
from radixkv.attention.cascade_plan import CascadeLevel, CascadePlan
from radixkv.debug import debug_checks_enabled
from radixkv.engine.names import CASCADE_MODES

# K+V values (per layer) a step must save for "auto" to pick the cascade, by the KV's bytes per
# value (module docstring); other sizes use the fp32 value
MIN_STEP_SAVED_VALUES: dict[int, int] = {4: 5 << 17, 2: 1 << 19}


class TrieNode(Protocol):
    """What the planner reads of a trie node (``radixkv.cache.TreeNode`` has it)."""

    @property
    def parent(self) -> TrieNode | None: ...

    @property
    def num_tokens(self) -> int: ...


class DecodeEntry(NamedTuple):
    """One decoding sequence as the planner sees it.

    ``page_table[:num_shared_pages]`` are the pages of the trie path root -> ``node`` (``node``
    may be None or a root when nothing is shared, then ``num_shared_pages`` is 0); ``seq_len``
    counts every token the step attends to, the one being decoded included. (A NamedTuple: the
    engine builds one per sequence per decode step.)
    """

    node: TrieNode | None
    page_table: Sequence[int]
    seq_len: int
    num_shared_pages: int


@dataclass(frozen=True)
class CascadeDecision:
    """The plan for one decode step.

    ``order[r]`` is the index (into the planner's input) of the sequence whose query is row
    ``r`` of ``plan``; the caller runs the batch in this order (or permutes its queries).
    ``kv_tokens_plain`` / ``kv_tokens_cascade``: KV tokens one layer reads without / with the
    cascade (equal when ``use_cascade`` is False). A plain decision's ``plan`` (one level
    listing every page of the batch, which the engine never reads) is built on first access,
    from the entries' page tables as they are then.
    """

    order: tuple[int, ...]
    use_cascade: bool
    kv_tokens_plain: int
    kv_tokens_cascade: int
    num_shared_segments: int
    build_plan: Callable[[], CascadePlan] = field(repr=False, compare=False)

    @cached_property
    def plan(self) -> CascadePlan:
        return self.build_plan()

    @property
    def num_levels(self) -> int:
        return len(self.plan.levels)


class _Columns(NamedTuple):
    """A step's entries column by column (``DecodeEntry`` fields, one sequence per index)."""

    nodes: tuple[TrieNode | None, ...]
    tables: Sequence[Sequence[int]]
    lens: Sequence[int]
    num_shared: tuple[int, ...]

    def entries(self) -> list[DecodeEntry]:
        """The entries themselves (for the checks and a build from the trie)."""
        return list(map(DecodeEntry, self.nodes, self.tables, self.lens, self.num_shared))


@dataclass(frozen=True)
class _Shared:
    """What a plan's shared levels are, for reuse while the same nodes stay locked."""

    nodes: tuple[TrieNode | None, ...]  # held: identities cannot be reused while cached
    num_shared: tuple[int, ...]
    order: tuple[int, ...]
    levels: tuple[CascadeLevel, ...]
    covered: tuple[tuple[tuple[int, int], ...], ...]  # per row: page ranges read when shared
    shared_tokens: int  # KV tokens the shared levels read
    num_segments: int
    # per entry: the segment its path ends in is traversed by it alone (it may grow below)
    private: tuple[bool, ...] = ()
    # per row, when every row's shared pages are one leading range: where its own pages start
    # (the last level then takes each table's slice from there, at C speed); else None
    starts: tuple[int, ...] | None = None


def _structure(s: _Shared) -> tuple[object, ...]:
    """What a plan takes from its shared part, beside the nodes and shared page counts."""
    return (s.order, s.levels, s.covered, s.shared_tokens, s.num_segments, s.private)


class _Seg:
    """A chain of trie nodes traversed by exactly the same sequences."""

    __slots__ = ("children", "depth", "ends", "first_row", "num_pages", "page_start", "rows")

    def __init__(self, page_start: int, depth: int) -> None:
        self.page_start = page_start  # offset of the segment's first page in each member's table
        self.num_pages = 0
        self.depth = depth  # number of shared ancestors kept (set when decided)
        self.children: list[_Seg] = []
        self.ends: list[int] = []  # entries whose path ends in this segment
        self.first_row = 0
        self.rows = 0


class CascadePlanner:
    """Builds a :class:`CascadeDecision` for each decode step. It keeps only the last step's
    shared structure, reused while the same nodes stay locked (see the module docstring)."""

    def __init__(
        self,
        page_size: int,
        *,
        mode: str = "auto",
        min_saved_tokens: int = 512,
        min_step_saved_tokens: int = 4096,
        min_step_saved_fraction: float = 0.1,
        layer_windows: Sequence[int] = (),
        check_entries: bool | None = None,
    ) -> None:
        """``check_entries``: validate every entry of every ``plan`` call (None: with the debug
        checks, radixkv/debug.py; the engine's entries are right by construction)."""
        if mode not in CASCADE_MODES:
            raise ValueError(f"cascade mode must be one of {CASCADE_MODES}, got {mode!r}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if min(min_saved_tokens, min_step_saved_tokens) < 0:
            raise ValueError("min_saved_tokens and min_step_saved_tokens must be >= 0")
        if not 0.0 <= min_step_saved_fraction <= 1.0:
            raise ValueError("min_step_saved_fraction must be in [0, 1]")
        self.page_size = page_size
        self.mode = mode
        self.min_saved_tokens = min_saved_tokens
        self.min_step_saved_tokens = min_step_saved_tokens
        self.min_step_saved_fraction = min_step_saved_fraction
        # the model's sliding windows (ModelConfig.layer_windows): a layer whose window is
        # shorter than a decode row attends without the cascade (cascade_backend.py), so a step
        # where every layer is such gets a plain decision
        self.layer_windows = tuple(layer_windows)
        self._last: _Shared | None = None  # the last cascade plan's shared part (module doc)
        self.check_entries = debug_checks_enabled() if check_entries is None else check_entries
        # the last level's pages of the last plan: (its shared part, the rows' page tables
        # (held), their page counts, kv_indptr, kv_indices); see _last_level
        self._last_pages: tuple[_Shared, tuple[Sequence[int], ...], list[int], tuple[int, ...],
                                tuple[int, ...]] | None = None  # fmt: skip

    @staticmethod
    def min_step_tokens_for(kv_values_per_token: int, bytes_per_value: int = 4) -> int:
        """``min_step_saved_tokens`` for a model with ``kv_values_per_token`` K+V values per
        token and layer (``2 * num_kv_heads * head_dim``) held in ``bytes_per_value`` bytes
        each: ``MIN_STEP_SAVED_VALUES`` of them (radixkv-tiny's 128: 5,120 in fp32, 4,096 in
        bf16)."""
        if kv_values_per_token < 1:
            raise ValueError(f"kv_values_per_token must be >= 1, got {kv_values_per_token}")
        values = MIN_STEP_SAVED_VALUES.get(bytes_per_value, MIN_STEP_SAVED_VALUES[4])
        return -(-values // kv_values_per_token)

    # ---------------------------------------------------------------- public
    def plan(self, entries: Sequence[DecodeEntry]) -> CascadeDecision:
        if not entries:
            raise ValueError("cascade planner: empty decode batch")
        nodes, tables, lens, shared = zip(*entries, strict=True)  # columns, at C speed
        return self.plan_columns(nodes, tables, lens, shared)

    def plan_columns(
        self,
        nodes: Sequence[TrieNode | None],
        page_tables: Sequence[Sequence[int]],
        seq_lens: Sequence[int],
        num_shared_pages: Sequence[int],
    ) -> CascadeDecision:
        """:meth:`plan` of the entries ``DecodeEntry(nodes[i], page_tables[i], seq_lens[i],
        num_shared_pages[i])``, given column by column (the engine's decode step: no entry
        objects to build per row and step)."""
        cols = _Columns(tuple(nodes), page_tables, seq_lens, tuple(num_shared_pages))
        n = len(cols.nodes)
        if not n:
            raise ValueError("cascade planner: empty decode batch")
        if not len(page_tables) == len(seq_lens) == len(cols.num_shared) == n:
            raise ValueError("cascade planner: columns differ in length")
        ps = self.page_size
        if self.check_entries:
            self._check(cols.entries())
        plain_tokens = sum(seq_lens)
        if self.mode == "off" or n == 1:
            return self._plain(cols, plain_tokens)
        if self.layer_windows:
            cut = outgrown_windows(self.layer_windows, max(seq_lens))
            if all(w in cut for w in self.layer_windows):
                return self._plain(cols, plain_tokens)
        shared = self._shared_part(cols)
        if not shared.levels:  # nothing shared enough to keep
            return self._plain(cols, plain_tokens)
        last = self._last_level(cols, shared)
        cascade_tokens = shared.shared_tokens + last.kv_tokens_read(ps)
        saved = plain_tokens - cascade_tokens
        if self.mode == "auto" and (
            saved < self.min_step_saved_tokens
            or saved < self.min_step_saved_fraction * plain_tokens
        ):
            return self._plain(cols, plain_tokens)
        plan = CascadePlan(ps, n, (*shared.levels, last))
        return CascadeDecision(
            shared.order, True, plain_tokens, cascade_tokens, shared.num_segments, lambda: plan
        )

    def _check(self, entries: Sequence[DecodeEntry]) -> None:
        """ValueError naming the first entry whose page table cannot hold its tokens, or whose
        shared pages reach the decoded token's page."""
        ps = self.page_size
        for i, e in enumerate(entries):
            n_pages = -(-e.seq_len // ps)
            if e.seq_len < 1 or len(e.page_table) < n_pages:
                raise ValueError(
                    f"entry {i}: seq_len {e.seq_len} needs {n_pages} pages, "
                    f"page table has {len(e.page_table)}"
                )
            if not 0 <= e.num_shared_pages < n_pages:
                # the decoded token's page is private, so shared pages are strictly fewer
                raise ValueError(
                    f"entry {i}: num_shared_pages {e.num_shared_pages} must be < {n_pages} "
                    "(the page of the token being decoded is never shared)"
                )

    # ---------------------------------------------------------------- steps
    def _plain(self, cols: _Columns, plain_tokens: int) -> CascadeDecision:
        ps = self.page_size
        tables = list(cols.tables)
        lens = list(cols.lens)
        order = tuple(range(len(lens)))
        return CascadeDecision(
            order, False, plain_tokens, plain_tokens, 0, lambda: CascadePlan.plain(tables, lens, ps)
        )

    def _shared_part(self, cols: _Columns) -> _Shared:
        """The shared levels for these entries: the last step's when they lock the same nodes
        (see the module docstring), else built from the trie (no levels: nothing to share)."""
        nodes, num_shared = cols.nodes, cols.num_shared
        last = self._last
        # tuple equality tests identity first; nodes have no __eq__ of their own
        if last is not None and last.num_shared == num_shared and last.nodes == nodes:
            return last
        grown = None if last is None else self._grown(last, nodes, num_shared)
        if grown is not None and not self.check_entries:
            self._last = grown
            return grown
        built = self._build(cols.entries(), nodes, num_shared)
        if grown is not None:  # (debug checks) what the shortcut gave is what a build gives
            assert _structure(grown) == _structure(built), "cascade shortcut differs"
        self._last = built
        return built

    def _build(
        self,
        entries: Sequence[DecodeEntry],
        nodes: tuple[TrieNode | None, ...],
        num_shared: tuple[int, ...],
    ) -> _Shared:
        """The shared levels of these entries, built from the trie."""
        root = self._build_tree(entries)
        threshold = 1 if self.mode == "on" else max(1, self.min_saved_tokens)
        kept = self._decide(root, threshold)
        private = self._private(root, len(entries))
        if kept:
            order = self._assign_rows(root)
            return self._shared_levels(entries, nodes, num_shared, order, kept, private)
        return _Shared(nodes, num_shared, (), (), (), 0, 0, private)

    @staticmethod
    def _private(root: _Seg, n: int) -> tuple[bool, ...]:
        """Per entry: whether the segment its path ends in has it alone (no other end, no
        child segment)."""
        private = [False] * n
        stack = list(root.children)
        while stack:
            seg = stack.pop()
            if len(seg.ends) == 1 and not seg.children:
                private[seg.ends[0]] = True
            stack.extend(seg.children)
        return tuple(private)

    def _grown(
        self, last: _Shared, nodes: tuple[TrieNode | None, ...], num_shared: tuple[int, ...]
    ) -> _Shared | None:
        """The last shared part for these nodes when a build would give the same one, else None.

        That is so when every entry whose node changed had its last path's end segment to
        itself (``private``) and its new node lies below its old one, the nodes between being
        on no other changed entry's way (the usual decode step: some sequences publish a page
        under their own branch). No other entry goes through the old node (it was private), so
        none goes through those below it either, except another changed entry (checked): the
        private segment only grows downwards, it stays unshared, and the kept segments, the row
        order and the covered ranges stay as they were."""
        if len(last.nodes) != len(nodes) or not last.private:
            return None
        ps = self.page_size
        counts = list(last.num_shared)
        changed = [i for i, (a, b) in enumerate(zip(last.nodes, nodes)) if a is not b]
        # an old node of a changed entry is never on another changed entry's way down
        seen = {id(last.nodes[i]) for i in changed}
        for i in changed:
            old, node = last.nodes[i], nodes[i]
            if old is None or not last.private[i]:
                return None
            pages = 0
            while node is not old:
                if node is None or id(node) in seen:
                    return None
                seen.add(id(node))
                pages += node.num_tokens // ps
                node = node.parent
            counts[i] += pages
        if tuple(counts) != num_shared:
            return None
        return dataclasses.replace(last, nodes=nodes, num_shared=num_shared)

    def _path(self, i: int, e: DecodeEntry) -> list[TrieNode]:
        """Trie nodes holding pages, root first; their pages total ``num_shared_pages``."""
        path: list[TrieNode] = []
        node = e.node
        total = 0
        while node is not None:
            n = node.num_tokens // self.page_size
            if n:
                path.append(node)
                total += n
            node = node.parent
        if total != e.num_shared_pages:
            raise ValueError(
                f"entry {i}: its trie path holds {total} pages but num_shared_pages is "
                f"{e.num_shared_pages}"
            )
        path.reverse()
        return path

    def _build_tree(self, entries: Sequence[DecodeEntry]) -> _Seg:
        """Tree of compressed segments over all entries' paths (the root holds no pages)."""
        # node-level tree first: id(node) -> (node, children ids in first-seen order, ends)
        kids: dict[int, list[TrieNode]] = {0: []}
        ends: dict[int, list[int]] = {0: []}
        for i, e in enumerate(entries):
            parent_key = 0
            for node in self._path(i, e):
                key = id(node)
                if key not in kids:
                    kids[key], ends[key] = [], []
                    kids[parent_key].append(node)
                parent_key = key
            ends[parent_key].append(i)

        root = _Seg(0, 0)
        root.ends = ends[0]
        stack = [(root, node) for node in reversed(kids[0])]
        while stack:
            parent_seg, node = stack.pop()
            seg = _Seg(parent_seg.page_start + parent_seg.num_pages, 0)
            parent_seg.children.append(seg)
            # extend the chain while exactly the same sequences continue through one child
            while True:
                seg.num_pages += node.num_tokens // self.page_size
                key = id(node)
                if ends[key] or len(kids[key]) != 1:
                    break
                node = kids[key][0]
            seg.ends = ends[key]
            stack.extend((seg, child) for child in reversed(kids[key]))
        return root

    @staticmethod
    def _assign_rows(root: _Seg) -> list[int]:
        """Depth-first row order; sets each segment's ``first_row``/``rows``. Iterative."""
        order: list[int] = []
        stack: list[tuple[_Seg, bool]] = [(root, False)]
        while stack:
            seg, done = stack.pop()
            if done:
                seg.rows = len(order) - seg.first_row
                continue
            seg.first_row = len(order)
            order.extend(seg.ends)
            stack.append((seg, True))
            stack.extend((c, False) for c in reversed(seg.children))
        return order

    def _decide(self, root: _Seg, threshold: int) -> list[_Seg]:
        """Mark segments worth sharing; set their level (kept ancestors). Returns them."""
        # group sizes bottom-up (iterative post-order)
        size: dict[int, int] = {}
        post: list[_Seg] = []
        stack = [root]
        while stack:
            seg = stack.pop()
            post.append(seg)
            stack.extend(seg.children)
        for seg in reversed(post):
            size[id(seg)] = len(seg.ends) + sum(size[id(c)] for c in seg.children)
        kept: list[_Seg] = []
        stack2: list[tuple[_Seg, int]] = [(c, 0) for c in root.children]
        while stack2:
            seg, depth = stack2.pop()
            g = size[id(seg)]
            if g >= 2 and seg.num_pages * self.page_size * (g - 1) >= threshold:
                seg.depth = depth
                kept.append(seg)
                depth += 1
            else:
                seg.depth = -1
            stack2.extend((c, depth) for c in seg.children)
        return kept

    def _shared_levels(
        self,
        entries: Sequence[DecodeEntry],
        nodes: tuple[TrieNode | None, ...],
        num_shared: tuple[int, ...],
        order: list[int],
        kept: list[_Seg],
        private: tuple[bool, ...],
    ) -> _Shared:
        ps = self.page_size
        n = len(order)
        num_levels = 1 + max(s.depth for s in kept)
        # per level: segments sorted by first row
        by_level: list[list[_Seg]] = [[] for _ in range(num_levels)]
        for s in kept:
            by_level[s.depth].append(s)
        # per row: page ranges [a, b) of its table read at shared levels
        covered: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        levels: list[CascadeLevel] = []
        tokens = 0
        for segs in by_level:
            segs.sort(key=lambda s: s.first_row)
            qo, kv, last = [0], [0], []
            idx: list[int] = []
            row = 0
            for s in segs:
                if s.first_row > row:  # rows with nothing shared at this level
                    qo.append(s.first_row)
                    kv.append(len(idx))
                    last.append(0)
                lo, hi = s.page_start, s.page_start + s.num_pages
                table = entries[order[s.first_row]].page_table
                idx.extend(table[lo:hi])
                qo.append(s.first_row + s.rows)
                kv.append(len(idx))
                last.append(ps)
                for r in range(s.first_row, s.first_row + s.rows):
                    covered[r].append((lo, hi))
                row = s.first_row + s.rows
                tokens += s.num_pages * ps
            if row < n:
                qo.append(n)
                kv.append(len(idx))
                last.append(0)
            levels.append(CascadeLevel(tuple(qo), tuple(kv), tuple(idx), tuple(last)))
        cov = tuple(tuple(sorted(c)) for c in covered)
        starts = None
        if all(len(c) <= 1 and (not c or c[0][0] == 0) for c in cov):
            starts = tuple([c[0][1] if c else 0 for c in cov])
        return _Shared(
            nodes,
            num_shared,
            tuple(order),
            tuple(levels),
            cov,
            tokens,
            len(kept),
            private,
            starts,
        )

    def _last_level(self, cols: _Columns, shared: _Shared) -> CascadeLevel:
        """Each row's pages not read at a shared level (its ranges there are disjoint).

        Its pages are the last step's while the shared part is the same object (same nodes,
        same shared page counts), the rows' page tables are the same and each row's page count
        is unchanged: a table's pages up to its count change only when pages are published
        (the shared page counts change) or the sequence is released (a new table), so a decode
        step mostly rebuilds only the last page lengths."""
        ps = self.page_size
        n = len(shared.order)
        lens = np.fromiter(map(cols.lens.__getitem__, shared.order), np.int64, n)
        n_pages = (-(-lens // ps)).tolist()
        tables = tuple(map(cols.tables.__getitem__, shared.order))
        memo = self._last_pages
        # (tuple equality: identity first, then contents: equal contents have equal pages)
        if memo is not None and memo[0] is shared and memo[2] == n_pages and memo[1] == tables:
            kv, idx = memo[3], memo[4]
        elif shared.starts is not None:  # one leading shared range per row: slices, at C speed
            own = list(map(operator.getitem, tables, map(slice, shared.starts, n_pages)))
            kv = (0, *itertools.accumulate(map(len, own)))
            idx = tuple(itertools.chain.from_iterable(own))
            self._last_pages = (shared, tables, n_pages, kv, idx)
        else:
            kv_l, idx_l = [0], []
            for table, k, ranges in zip(tables, n_pages, shared.covered):
                start = 0
                for lo, hi in ranges:
                    idx_l.extend(table[start:lo])
                    start = hi
                idx_l.extend(table[start:k])
                kv_l.append(len(idx_l))
            kv, idx = tuple(kv_l), tuple(idx_l)
            self._last_pages = (shared, tables, n_pages, kv, idx)
        last = tuple(((lens - 1) % ps + 1).tolist())  # tokens in each row's last page
        qo = tuple(range(n + 1))
        if self.check_entries:  # (else right by construction: one segment per row)
            return CascadeLevel(qo, kv, idx, last)
        return CascadeLevel.unchecked(qo, kv, idx, last)
