"""Text and Graphviz renderings of a radix trie (for debugging, docs and notebooks).

Functions of the trie's nodes, reading only TreeNode's public attributes; RadixCache.pretty
and RadixCache.to_dot call them with the cache's root and the header facts they need. This
module does not know the cache class.
"""

from __future__ import annotations

from collections.abc import Iterable

from radixkv.cache.node import TreeNode


def _label(node: TreeNode, max_tokens_shown: int) -> str:
    toks = node.tokens
    shown = " ".join(map(str, toks[:max_tokens_shown]))
    if len(toks) > max_tokens_shown:
        shown += f" ...(+{len(toks) - max_tokens_shown})"
    return shown


def _page_list(pages: list[int]) -> str:
    return ",".join(map(str, pages[:4])) + (",..." if len(pages) > 4 else "")


def _sorted_children(node: TreeNode) -> list[TreeNode]:
    # namespace roots last; token order first, creation order breaks ties (readable, stable)
    return sorted(node.iter_children(), key=lambda c: (c.key == b"", c.key[:64], c.node_id))


def render_text(root: TreeNode, header: str, max_tokens_shown: int = 8, tiers: bool = False) -> str:
    """``header``, then one line per node under ``root``, indented by depth: tokens, pages,
    lock count, access time, hits. With ``tiers`` (a cache with a host tier) each line also
    says where the node lives (device, host, device+host), its host pages, and the copies in
    flight on it."""
    lines = [header]

    def walk(node: TreeNode, indent: str) -> None:
        kids = _sorted_children(node)
        for i, c in enumerate(kids):
            last = i == len(kids) - 1
            branch = "└─ " if last else "├─ "
            if not c.key:
                text = f"namespace {c.namespace!r}"
            elif not tiers:
                text = (
                    f"[{_label(c, max_tokens_shown)}] {c.num_tokens} tok, "
                    f"pages [{_page_list(c.pages)}], "
                    f"lock={c.lock_ref}, t={c.last_access}, hits={c.hit_count}"
                )
            else:
                flight = f", copying={c.copies_in_flight}" if c.copies_in_flight else ""
                text = (
                    f"[{_label(c, max_tokens_shown)}] {c.num_tokens} tok, {c.residency}, "
                    f"pages [{_page_list(c.pages)}], host [{_page_list(c.host_pages)}], "
                    f"lock={c.lock_ref}, t={c.last_access}, hits={c.hit_count}{flight}"
                )
            lines.append(indent + branch + text)
            walk(c, indent + ("   " if last else "│  "))

    walk(root, "")
    return "\n".join(lines)


def render_dot(
    nodes: Iterable[TreeNode],
    evictable: Iterable[TreeNode],
    max_tokens_shown: int = 6,
    tiers: bool = False,
) -> str:
    """Graphviz source for ``nodes`` (a whole trie, root first): one box per node; locked nodes
    are filled, the ``evictable`` leaves dashed. With ``tiers`` each label also says where the
    node lives, and nodes held in host memory only are drawn grey with a dotted border."""
    out = ["digraph radix {", '  node [shape=box, fontname="monospace", fontsize=10];']
    dashed = {n.node_id for n in evictable}
    for node in nodes:
        if node.parent is None:
            label = "root"
        elif not node.key:
            label = f"namespace {node.namespace!r}"
        else:
            label = (
                f"{_label(node, max_tokens_shown)}\\n{node.num_tokens} tok / "
                f"{node.num_pages} pages\\nlock={node.lock_ref} t={node.last_access}"
            )
            if tiers:
                label += f"\\n{node.residency}"
        label = label.replace('"', '\\"')
        style = ""
        if node.lock_ref > 0:
            style = ', style=filled, fillcolor="#ffd28a"'
        elif tiers and node.key and not node.on_device:
            style = ', style="filled,dotted", fillcolor="#dddddd"'
        elif node.node_id in dashed:
            style = ", style=dashed"
        out.append(f'  n{node.node_id} [label="{label}"{style}];')
        if node.parent is not None:
            out.append(f"  n{node.parent.node_id} -> n{node.node_id};")
    out.append("}")
    return "\n".join(out)
