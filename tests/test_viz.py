"""radixkv.viz: the table, the layout and the matplotlib drawing of a real RadixCache."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from radixkv.cache.page_pool import PagePool
from radixkv.cache.radix_cache import RadixCache
from radixkv.viz import draw_tree, find_node, layout_tree, node_table, save_tree, text_tree

PS = 4


def _serve(cache: RadixCache, tokens: list[int], namespace: object = None) -> None:
    """match -> lock -> alloc -> insert -> unlock, as the engine does."""
    m = cache.match_prefix(tokens, namespace=namespace)
    cache.lock(m.node)
    n_full = len(tokens) // PS
    pages = m.pages + cache.alloc(n_full - len(m.pages))
    cache.insert(tokens[: n_full * PS], pages, namespace=namespace)
    cache.unlock(m.node)


@pytest.fixture
def cache() -> RadixCache:
    c = RadixCache(PagePool(64), page_size=PS)
    sys_prompt = list(range(100, 112))  # 3 pages shared by everyone
    _serve(c, [*sys_prompt, 1, 2, 3, 4, 5, 6, 7, 8])
    _serve(c, [*sys_prompt, 9, 9, 9, 9])
    _serve(c, [*sys_prompt, 1, 2, 3, 4, 7, 7, 7, 7])  # splits the first leaf after one page
    _serve(c, [50] * 8, namespace="t2")
    c.check_invariants()
    return c


def _labels(fig) -> list[str]:
    return [t.get_text() for t in fig.axes[0].texts]


def test_node_table_matches_the_trie(cache: RadixCache) -> None:
    rows = node_table(cache)
    nodes = list(cache.iter_nodes())
    assert len(rows) == len(nodes) == cache.num_nodes
    assert rows[0].parent is None and rows[0].level == 0 and rows[0].num_tokens == 0
    assert sum(len(r.pages) for r in rows) == cache.num_cached_pages
    for r, n in zip(rows, nodes):
        assert r.pages == tuple(n.pages) and r.lock_ref == n.lock_ref
        assert r.hit_count == n.hit_count and r.namespace == n.namespace
        if r.parent is not None:
            parent = rows[r.parent]
            assert nodes[r.parent] is n.parent
            assert r.level == parent.level + 1
            assert r.depth_tokens == parent.depth_tokens + r.num_tokens
    # the shared system prompt: one node of 3 pages with two children below it
    shared = [r for r in rows if r.num_tokens == 12]
    assert len(shared) == 1
    assert sum(1 for r in rows if r.parent == shared[0].index) == 2


def test_layout_is_tidy(cache: RadixCache) -> None:
    pos = layout_tree(cache)
    rows = node_table(cache)
    assert set(pos) == {r.index for r in rows}
    kids: dict[int, list[int]] = {}
    for r in rows:
        assert pos[r.index][1] == r.level
        if r.parent is not None:
            kids.setdefault(r.parent, []).append(r.index)
    leaves = [r.index for r in rows if r.index not in kids]
    xs = sorted(pos[i][0] for i in leaves)
    assert xs == [float(i) for i in range(len(leaves))]  # leaves on distinct columns
    for parent, children in kids.items():
        cx = [pos[c][0] for c in children]
        assert min(cx) <= pos[parent][0] <= max(cx)


def test_layout_of_a_deep_chain_does_not_recurse() -> None:
    c = RadixCache(PagePool(1200), page_size=1)
    toks: list[int] = []
    for i in range(1100):  # each insert extends the last: a chain deeper than the recursion limit
        toks.append(i)
        m = c.match_prefix(toks)
        c.insert(toks, m.pages + c.alloc(1))
    pos = layout_tree(c)
    assert max(lvl for _, lvl in pos.values()) == 1100


def test_draw_tree_labels_locks_and_recency(cache: RadixCache) -> None:
    m = cache.match_prefix([*list(range(100, 112)), 9, 9, 9, 9, 0])
    cache.lock(m.node)
    before = cache.stats
    fig = draw_tree(cache, title="t", annotations={m.node: "branch X"})
    assert cache.stats == before  # drawing mutates nothing
    cache.check_invariants()

    labels = _labels(fig)
    assert "branch X" in labels
    assert any(lbl.startswith("root") for lbl in labels)
    assert any("namespace" in lbl and "'t2'" in lbl for lbl in labels)
    texts = {t.get_text(): t for t in fig.axes[0].texts}
    # the locked leaf and its locked parent have a red border; unlocked nodes do not
    for n in cache.iter_nodes():
        if n.num_tokens == 0:
            continue
        label = next(lbl for lbl in labels if f"hits {n.hit_count} · lock {n.lock_ref}" in lbl
                     and f"{n.num_tokens} tok" in lbl and str(n.pages[0]) in lbl)  # fmt: skip
        edge = texts[label].get_bbox_patch().get_edgecolor()
        is_red = edge[0] > 0.8 and edge[1] < 0.2
        assert is_red == (n.lock_ref > 0), (label, edge)
    # recency: the most recently used node is drawn in the brightest colour of the map
    newest = max((n for n in cache.iter_nodes() if n.num_tokens), key=lambda n: n.last_access)
    lbl = next(t for t in labels if f"pages {newest.pages[0]}" in t)
    from matplotlib import colormaps

    face = texts[lbl].get_bbox_patch().get_facecolor()
    assert tuple(round(x, 3) for x in face) == tuple(
        round(x, 3) for x in colormaps["viridis"](0.95)
    )
    # a highlighted node is outlined orange, locked or not; the lock count stays in its label
    fig = draw_tree(cache, highlight=[m.node], highlight_label="shared")
    texts = {t.get_text(): t for t in fig.axes[0].texts}
    lbl = next(t for t in texts if f"pages {m.node.pages[0]}" in t)
    assert "lock 1" in lbl
    edge = texts[lbl].get_bbox_patch().get_edgecolor()
    assert edge[0] > 0.9 and 0.4 < edge[1] < 0.7 and edge[2] < 0.1  # darkorange
    assert "shared" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    cache.unlock(m.node)


def test_token_text_and_elision() -> None:
    c = RadixCache(PagePool(8), page_size=PS)
    _serve(c, list(range(16)))
    fig = draw_tree(c, token_text=lambda ids: "w" * 40, max_pages_shown=2)
    node_label = next(t for t in _labels(fig) if "tok" in t)
    assert node_label.startswith("'" + "w" * 17 + "…'")
    assert "pages 0,1,+2" in node_label
    fig = draw_tree(c, max_tokens_shown=3)
    assert any(t.startswith("[0,1,2,+13]") for t in _labels(fig))


def test_empty_cache_and_given_axes() -> None:
    from matplotlib.figure import Figure

    c = RadixCache(PagePool(4), page_size=PS)
    fig = draw_tree(c)
    assert _labels(fig) == ["root"]
    outer = Figure()
    ax = outer.add_subplot()
    assert draw_tree(c, ax=ax) is outer


def test_save_tree_writes_files(cache: RadixCache, tmp_path: Path) -> None:
    png, svg = tmp_path / "t.png", tmp_path / "t.svg"
    save_tree(cache, str(png), title="x")
    save_tree(cache, str(svg))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in svg.read_bytes()[:500]


def test_no_pyplot_and_lazy_matplotlib() -> None:
    code = (
        "import sys, radixkv.viz as v\n"
        "assert 'matplotlib' not in sys.modules, 'imported eagerly'\n"
        "from radixkv import PagePool, RadixCache\n"
        "v.draw_tree(RadixCache(PagePool(2), page_size=1)).savefig('/dev/null', format='png')\n"
        "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def test_find_node_reads_without_touching(cache: RadixCache) -> None:
    sys_prompt = list(range(100, 112))
    before = cache.stats
    times = {id(n): n.last_access for n in cache.iter_nodes()}
    leaf = find_node(cache, [*sys_prompt, 9, 9, 9, 9, 5, 5])
    assert leaf.depth_tokens == 16 and leaf.tokens == [9, 9, 9, 9]
    # ends at a node boundary: 14 shared tokens stop at the 12-token system-prompt node
    mid = find_node(cache, [*sys_prompt, 9, 9])
    assert mid.depth_tokens == 12 and mid is leaf.parent
    assert find_node(cache, [7, 7, 7, 7]) is cache.root
    # namespaces are separate: the same tokens are found only under their own namespace
    assert find_node(cache, [50] * 8, namespace="t2").depth_tokens == 8
    assert find_node(cache, [50] * 8).depth_tokens == 0
    assert find_node(cache, [50] * 8, namespace="nope") is cache.root
    assert cache.stats == before
    assert times == {id(n): n.last_access for n in cache.iter_nodes()}


def test_too_big_a_trie_is_refused_clearly(cache: RadixCache) -> None:
    n = cache.num_nodes
    with pytest.raises(ValueError, match=f"{n} nodes"):
        draw_tree(cache, max_nodes=n - 1)
    assert draw_tree(cache, max_nodes=n) is not None


def test_residency_in_the_table_and_the_drawing() -> None:
    """A cache with a host tier: rows and boxes say where each node's pages are."""
    from cache_helpers import make_tiered, serve

    c, cp = make_tiered(num_pages=8, page_size=PS)
    serve(c, cp, list(range(8)))
    serve(c, cp, [0, 1, 2, 3, 9, 9, 9, 9])
    c.wait_all()
    c.evict(1)  # the least recent leaf goes to the host tier
    rows = {r.num_tokens and tuple(n.tokens): r for r, n in zip(node_table(c), c.iter_nodes())}
    assert rows[0].residency == ""
    assert rows[(0, 1, 2, 3)].residency == "device+host" and rows[(0, 1, 2, 3)].host_pages
    host_row = rows[(4, 5, 6, 7)]
    assert host_row.residency == "host" and host_row.pages == () and len(host_row.host_pages) == 1
    fig = draw_tree(c)
    texts = {t.get_text(): t for t in fig.axes[0].texts}
    host_label = next(t for t in texts if t.startswith("[4,5,6,7]"))
    assert "host · host " in host_label
    patch = texts[host_label].get_bbox_patch()
    assert patch.get_linestyle() in ("--", "dashed") and patch.get_facecolor()[0] > 0.8
    assert "host only" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert all(r.residency == "device" for r in node_table(_tiny()) if r.num_tokens)


def _tiny() -> RadixCache:
    c = RadixCache(PagePool(4), page_size=PS)
    _serve(c, list(range(8)))
    return c


def test_text_tree_decodes_each_node(cache: RadixCache) -> None:
    """One line per node, indented under its parent, with the node's own tokens decoded; long
    texts cut with …, newlines shown as ⏎; max_lines cuts the listing and says so."""

    def words(ids) -> str:
        return " ".join("nl\n" if i == 3 else f"w{i}" for i in ids)

    text = text_tree(cache, words, max_chars=20)
    lines = text.splitlines()
    assert len(lines) == cache.num_nodes  # the root line, then a line per node
    assert lines[0].startswith(f"root ({cache.num_nodes - 1} nodes, ")
    shared = next(ln for ln in lines if "12 tok" in ln)
    assert shared[3:].startswith("'w100 w101 w102 w103…'  12 tok, 3 pages, hits")
    assert any("⏎" in ln for ln in lines) and not any("\n" in ln for ln in lines)
    assert any(ln.lstrip("│ ").startswith(("├─ ", "└─ ")) and ln.startswith("│") for ln in lines)
    assert "namespace 't2'" in text
    cut = text_tree(cache, words, max_lines=2).splitlines()
    assert cut[:2] == lines[:2] and cut[2] == f"... ({len(lines) - 2} more lines)"
