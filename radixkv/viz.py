"""Pictures of a radix prefix cache: a matplotlib drawing of the trie and a table of its nodes.

The renderer reads only the public, read-only node attributes every cache node exposes
(``parent``, ``num_tokens``, ``pages``, ``lock_ref``, ``last_access``, ``hit_count``,
``namespace``, ``depth_tokens``, ``tokens``; and, where a node has them, ``host_pages`` and
``residency``, which a cache with a host tier fills in) and ``cache.iter_nodes()``. It never mutates the
cache, so it is safe to call between any two cache or engine operations.

matplotlib is an optional dependency (extra ``viz``): it is imported inside the functions that
need it, and only the object-oriented API is used (an explicit ``Figure`` drawn by the Agg
canvas), so calling these functions never touches pyplot's global state or the user's backend.

Example:
    ```python
    from radixkv import PagePool, RadixCache
    from radixkv.viz import draw_tree

    cache = RadixCache(PagePool(32), page_size=4)
    ...
    fig = draw_tree(cache, title="after two inserts")
    fig.savefig("tree.png")
    ```
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # only for annotations; matplotlib stays a lazy import
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "NodeRow",
    "draw_tree",
    "find_node",
    "layout_tree",
    "node_table",
    "save_tree",
    "text_tree",
]


class _Node(Protocol):
    """The read-only view of a trie node that this module relies on."""

    parent: Any
    num_tokens: int
    pages: Sequence[int]
    lock_ref: int
    last_access: int
    hit_count: int
    namespace: Any
    depth_tokens: int
    tokens: Sequence[int]


class _Cache(Protocol):
    def iter_nodes(self) -> Iterable[Any]: ...


@dataclass(frozen=True)
class NodeRow:
    """One trie node as plain data (see `node_table`).

    Attributes:
        index: position of the node in ``cache.iter_nodes()`` order (0 is the root).
        parent: index of the parent node, or ``None`` for a root.
        level: number of edges from the node's root.
        num_tokens: length of this node's own key.
        depth_tokens: tokens from the root to the end of this node.
        pages: this node's own page ids.
        lock_ref: the node's lock count.
        last_access: the node's logical access time.
        hit_count: how many matches went through the node.
        namespace: the node's namespace.
        host_pages: page ids of the node's copy in the host tier (empty when it has none).
        residency: where the node's pages are: "device", "host" or "device+host" ("" for a
            root; "device" for a cache without a host tier).
    """

    index: int
    parent: int | None
    level: int
    num_tokens: int
    depth_tokens: int
    pages: tuple[int, ...]
    lock_ref: int
    last_access: int
    hit_count: int
    namespace: Any
    host_pages: tuple[int, ...] = ()
    residency: str = "device"


def _residency(node: Any) -> str:
    """``node.residency`` when the node has one, else what it must be without a host tier."""
    r = getattr(node, "residency", None)
    if r is not None:
        return str(r)
    return "" if int(node.num_tokens) == 0 else "device"


def _collect(cache: _Cache) -> tuple[list[Any], dict[int, list[int]], list[int]]:
    """Nodes in iteration order, child indices per node index, and root indices.

    Children are rebuilt from ``parent`` links (not from ``node.children``) so the drawing only
    depends on ``iter_nodes`` and ``parent``; a cache with one root per namespace draws as a
    forest.
    """
    nodes = list(cache.iter_nodes())
    index = {id(n): i for i, n in enumerate(nodes)}
    children: dict[int, list[int]] = {i: [] for i in range(len(nodes))}
    roots: list[int] = []
    for i, n in enumerate(nodes):
        p = n.parent
        if p is None or id(p) not in index:
            roots.append(i)
        else:
            children[index[id(p)]].append(i)
    return nodes, children, roots


def node_table(cache: _Cache) -> list[NodeRow]:
    """Every node of ``cache`` as a `NodeRow`, in ``iter_nodes()`` order (root first).

    Useful for printing a table or asserting on the tree's shape without reaching into nodes.
    """
    nodes, children, roots = _collect(cache)
    level = [0] * len(nodes)
    parent_of: dict[int, int | None] = {r: None for r in roots}
    stack = list(roots)
    while stack:
        i = stack.pop()
        for c in children[i]:
            level[c] = level[i] + 1
            parent_of[c] = i
            stack.append(c)
    return [
        NodeRow(
            index=i,
            parent=parent_of.get(i),
            level=level[i],
            num_tokens=int(n.num_tokens),
            depth_tokens=int(n.depth_tokens),
            pages=tuple(int(p) for p in n.pages),
            lock_ref=int(n.lock_ref),
            last_access=int(n.last_access),
            hit_count=int(n.hit_count),
            namespace=n.namespace,
            host_pages=tuple(int(p) for p in getattr(n, "host_pages", ())),
            residency=_residency(n),
        )
        for i, n in enumerate(nodes)
    ]


def find_node(cache: Any, tokens: Sequence[int], namespace: Any = None) -> Any:
    """The deepest node whose root-to-node path is a prefix of ``tokens``, without touching it.

    Unlike ``cache.match_prefix`` this reads only public node attributes: it refreshes no access
    time, counts no hit and splits nothing, so a picture can point at "where this request
    ends" without changing what it pictures. The result ends at a node boundary (it may be
    shorter than what ``match_prefix`` would return, which can split a node). Returns
    ``cache.root`` (or the namespace's root) when nothing matches.
    """
    toks = [int(t) for t in tokens]
    node = cache.root
    if namespace is not None:
        ns_root = next(
            (c for c in node.children if int(c.num_tokens) == 0 and c.namespace == namespace),
            None,
        )
        if ns_root is None:
            return node
        node = ns_root
    pos = 0
    while True:
        nxt = None
        for child in node.children:
            k = int(child.num_tokens)
            if k and child.namespace == namespace and list(child.tokens) == toks[pos : pos + k]:
                nxt = child
                break
        if nxt is None:
            return node
        node = nxt
        pos += int(nxt.num_tokens)


def layout_tree(cache: _Cache) -> dict[int, tuple[float, int]]:
    """A tidy layout: node index -> (x, level).

    Leaves take consecutive x positions in depth-first order (children sorted by their first
    token so the picture is stable across runs); a parent sits centred over its children. Roots
    of a forest are laid side by side.
    """
    nodes, children, roots = _collect(cache)

    def first_token(i: int) -> tuple[int, int]:
        toks = nodes[i].tokens
        return (int(toks[0]) if len(toks) else -1, i)

    pos: dict[int, tuple[float, int]] = {}
    next_x = 0.0
    # iterative post-order so deep tries never hit the recursion limit
    for r in roots:
        stack: list[tuple[int, int, bool]] = [(r, 0, False)]
        while stack:
            i, lvl, done = stack.pop()
            kids = sorted(children[i], key=first_token)
            if not kids:
                pos[i] = (next_x, lvl)
                next_x += 1.0
            elif done:
                xs = [pos[c][0] for c in kids]
                pos[i] = ((min(xs) + max(xs)) / 2.0, lvl)
            else:
                stack.append((i, lvl, True))
                stack.extend((c, lvl + 1, False) for c in reversed(kids))
    return pos


def _fmt_list(values: Sequence[int], limit: int) -> str:
    vals = [str(int(v)) for v in values[:limit]]
    more = len(values) - limit
    return ",".join(vals) + (f",+{more}" if more > 0 else "")


def _label(
    node: Any,
    is_root: bool,
    max_tokens_shown: int,
    max_pages_shown: int,
    token_text: Callable[[Sequence[int]], str] | None,
) -> str:
    if is_root or int(node.num_tokens) == 0:
        # the root, or a per-namespace root (no tokens, no pages)
        ns = node.namespace
        name = "root" if is_root else "namespace"
        return name if ns is None else f"{name}\n{ns!r}"
    toks = list(node.tokens)
    if token_text is not None:
        text = token_text(toks)
        text = text if len(text) <= 18 else text[:17] + "…"
        head = repr(text)
    else:
        head = "[" + _fmt_list(toks, max_tokens_shown) + "]"
    lines = [
        head,
        f"{node.num_tokens} tok · pages {_fmt_list(list(node.pages), max_pages_shown)}",
        f"hits {node.hit_count} · lock {node.lock_ref}",
    ]
    where = _residency(node)
    if where != "device":  # a host tier: say where the pages are
        host = _fmt_list(list(getattr(node, "host_pages", ())), max_pages_shown)
        lines.append(f"{where} · host {host}")
    return "\n".join(lines)


def draw_tree(
    cache: _Cache,
    *,
    ax: Axes | None = None,
    title: str | None = None,
    max_tokens_shown: int = 4,
    max_pages_shown: int = 4,
    token_text: Callable[[Sequence[int]], str] | None = None,
    highlight: Iterable[Any] = (),
    annotations: Mapping[Any, str] | None = None,
    highlight_label: str = "highlighted",
    cmap: str = "viridis",
    figsize: tuple[float, float] | None = None,
    dpi: int = 90,
    max_nodes: int = 300,
) -> Figure:
    """Draw the trie of ``cache`` and return the matplotlib ``Figure``.

    Each node is a box labelled with (the start of) its own token run, its token count, its own
    page ids, its hit count and its lock count. The fill colour shows recency (``last_access``,
    darkest = least recently used, brightest = most recently used, per ``cmap``); a locked node
    has a thick red border; nodes in ``highlight`` get a thick orange border instead (use it for
    shared pages or the path of one request; the lock count stays in the label). Edges are
    drawn from parent to child. With a host tier, a node also says where it lives
    ("device+host" or "host", and its host pages); a node held in host memory only is drawn
    light grey with a dashed border (its recency is in the label's hit and lock line only).

    Args:
        cache: a ``RadixCache`` (anything with ``iter_nodes()`` yielding nodes with the
            attributes listed in the module docstring). Not mutated.
        ax: draw into this Axes instead of a new figure (its figure is returned).
        title: optional axes title.
        max_tokens_shown: token ids shown per node before eliding.
        max_pages_shown: page ids shown per node before eliding.
        token_text: optional ``ids -> str`` (e.g. ``tokenizer.decode``) to label nodes with text.
        highlight: nodes to outline in orange.
        highlight_label: legend text for the orange outline.
        annotations: extra text drawn under a node, keyed by node object.
        cmap: matplotlib colormap name for recency.
        figsize: figure size in inches; by default it grows with the tree.
        dpi: resolution of a new figure.
        max_nodes: refuse (ValueError) to draw a larger trie, whose labels could not be read
            anyway; use `node_table` for big caches, or raise the limit.

    Returns:
        The figure holding the drawing (new unless ``ax`` was given).
    """
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    nodes, _children, roots = _collect(cache)
    if len(nodes) > max_nodes:
        raise ValueError(
            f"draw_tree: the trie has {len(nodes)} nodes (max_nodes={max_nodes}); a drawing that "
            "size is unreadable: use node_table(cache), or pass a larger max_nodes"
        )
    pos = layout_tree(cache)
    root_set = set(roots)
    width = max((x for x, _ in pos.values()), default=0.0) + 1.0
    depth = max((lvl for _, lvl in pos.values()), default=0) + 1

    if ax is None:
        if figsize is None:
            figsize = (min(2.3 * width + 1.0, 24.0), min(0.9 * depth + 1.2, 16.0))
        fig = Figure(figsize=figsize, dpi=dpi, layout="constrained")
        ax = fig.add_subplot()
    else:
        fig = ax.get_figure()
        assert fig is not None

    structural = {i for i, n in enumerate(nodes) if i in root_set or int(n.num_tokens) == 0}
    times = [int(n.last_access) for i, n in enumerate(nodes) if i not in structural]
    t_lo, t_hi = min(times, default=0), max(times, default=0)
    colour_map = colormaps[cmap]
    highlighted = {id(n) for n in highlight}
    notes = {id(k): v for k, v in (annotations or {}).items()}

    index = {id(n): i for i, n in enumerate(nodes)}
    for i, n in enumerate(nodes):
        p = n.parent
        if p is not None and id(p) in index:
            (x0, y0), (x1, y1) = pos[index[id(p)]], pos[i]
            ax.plot([x0, x1], [-y0, -y1], color="0.55", lw=1.2, zorder=1)

    host_only = {i for i, n in enumerate(nodes) if _residency(n) == "host"}
    for i, n in enumerate(nodes):
        x, lvl = pos[i]
        frac = 0.5 if t_hi == t_lo else (int(n.last_access) - t_lo) / (t_hi - t_lo)
        face = "white" if i in structural else colour_map(0.15 + 0.8 * frac)
        if i in host_only:
            face = (0.88, 0.88, 0.88, 1.0)
        # light text on dark fills, dark text on light ones
        r, g, b = face[:3] if not isinstance(face, str) else (1.0, 1.0, 1.0)
        text_colour = "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"
        if id(n) in highlighted:  # the caller's emphasis wins over the lock cue
            edge, lw = "darkorange", 3.5
        elif int(n.lock_ref) > 0 and i not in structural:
            edge, lw = "crimson", 3.0
        else:
            edge, lw = "0.3", 1.0
        style = "dashed" if i in host_only else "solid"
        label = _label(n, i in root_set, max_tokens_shown, max_pages_shown, token_text)
        ax.text(
            x,
            -lvl,
            label,
            ha="center",
            va="center",
            fontsize=7,
            family="monospace",
            color=text_colour,
            zorder=3,
            bbox={"boxstyle": "round,pad=0.35", "fc": face, "ec": edge, "lw": lw, "ls": style},
        )
        if id(n) in notes:
            # offset in points so the note sits just under the box whatever the figure's scale
            ax.annotate(
                notes[id(n)], (x, -lvl), xytext=(0, -22), textcoords="offset points",
                ha="center", va="top", fontsize=7, color="darkorange", fontweight="bold", zorder=3,
            )  # fmt: skip

    ax.set_xlim(-0.7, width - 0.3)
    ax.set_ylim(-(depth - 1) - 0.75, 0.6)
    ax.set_axis_off()
    if title:
        ax.set_title(title, fontsize=10)
    handles = [
        Patch(fc=colour_map(0.15), ec="0.3", label="least recent"),
        Patch(fc=colour_map(0.95), ec="0.3", label="most recent"),
        Patch(fc="white", ec="crimson", lw=2.5, label="locked (lock > 0)"),
    ]
    if host_only:
        handles.append(Patch(fc=(0.88, 0.88, 0.88), ec="0.3", ls="dashed", label="host only"))
    if highlighted:
        handles.append(Patch(fc="white", ec="darkorange", lw=2.5, label=highlight_label))
    ax.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), fontsize=7,
        frameon=False, ncols=len(handles),
    )  # fmt: skip
    return fig


def save_tree(cache: _Cache, path: str, **kwargs: Any) -> None:
    """Draw ``cache`` with `draw_tree` (same keyword arguments) and save it to ``path``.

    The format follows the file extension (``.png``, ``.svg``, ``.pdf``).
    """
    fig = draw_tree(cache, **kwargs)
    fig.savefig(path)


def _visible(text: str) -> str:
    """``text`` on one line: newlines as ⏎, tabs as →, other control characters as ·."""
    marks = {"\n": "⏎", "\t": "→"}
    return "".join(marks.get(ch, ch if ch.isprintable() else "·") for ch in text)


def text_tree(
    cache: _Cache,
    token_text: Callable[[Sequence[int]], str],
    *,
    max_chars: int = 60,
    max_lines: int | None = None,
) -> str:
    """The trie of ``cache`` as text, one line per node, with each node's own tokens decoded
    (``token_text``, e.g. ``tokenizer.decode``) instead of their ids: what a prefix cache holds,
    readable. A line gives the node's text (newlines shown as ⏎, cut to ``max_chars``
    characters with …), its token count, pages, hit count and lock count; children are indented
    under their parent in ``iter_nodes()`` order (the order they were cached). ``max_lines``
    cuts the listing, saying how many lines were left out.
    """
    nodes, children, roots = _collect(cache)
    lines: list[str] = []

    def line(i: int) -> str:
        n = nodes[i]
        if int(n.num_tokens) == 0:
            return f"namespace {n.namespace!r}"
        text = _visible(token_text(list(n.tokens)))
        if len(text) > max_chars:
            text = text[: max_chars - 1] + "…"
        return (
            f"{text!r}  {n.num_tokens} tok, {len(n.pages)} pages, hits {n.hit_count}, "
            f"lock {n.lock_ref}"
        )

    for r in roots:
        total = sum(int(nodes[i].num_tokens) for i in range(len(nodes)))
        lines.append(f"root ({len(nodes) - 1} nodes, {total:,} cached tokens)")
        stack: list[tuple[int, str, bool]] = [
            (c, "", k == len(children[r]) - 1) for k, c in enumerate(children[r])
        ][::-1]
        while stack:
            i, indent, last = stack.pop()
            lines.append(indent + ("└─ " if last else "├─ ") + line(i))
            kids = children[i]
            deeper = indent + ("   " if last else "│  ")
            stack.extend(
                (c, deeper, k == len(kids) - 1) for k, c in reversed(list(enumerate(kids)))
            )
    if max_lines is not None and len(lines) > max_lines:
        lines = [*lines[:max_lines], f"... ({len(lines) - max_lines} more lines)"]
    return "\n".join(lines)
