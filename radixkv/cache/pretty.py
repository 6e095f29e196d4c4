"""Text and Graphviz renderings of a radix trie (for debugging, docs and notebooks).

Functions of the trie's nodes, reading only TreeNode's public attributes; RadixCache.pretty
and RadixCache.to_dot call them with the cache's root and the header facts they need. This
module does not know the cache class.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from radixkv.cache.node import TreeNode


def label(node: TreeNode, max_tokens_shown: int) -> str:
    toks = node.tokens
    shown = " ".join(map(str, toks[:max_tokens_shown]))
    if len(toks) > max_tokens_shown:
        shown += f" ...(+{len(toks) - max_tokens_shown})"
    return shown


def page_list(pages: list[int]) -> str:
    return ",".join(map(str, pages[:4])) + (",..." if len(pages) > 4 else "")


def _sorted_children(node: TreeNode) -> list[TreeNode]:
    # namespace roots last; token order first, creation order breaks ties (readable, stable)
    return sorted(node.iter_children(), key=lambda c: (c.key == b"", c.key[:64], c.node_id))


def node_line(node: TreeNode, max_tokens_shown: int) -> str:
    """One node of a device cache: tokens, pages, lock count, access time, hits."""
    return (
        f"[{label(node, max_tokens_shown)}] {node.num_tokens} tok, "
        f"pages [{page_list(node.pages)}], "
        f"lock={node.lock_ref}, t={node.last_access}, hits={node.hit_count}"
    )


def tiered_node_line(node: TreeNode, max_tokens_shown: int) -> str:
    """One node of a cache with a host tier: ``node_line``'s facts plus where the node lives
    (device, host, device+host), its host pages, and the copies in flight on it."""
    flight = f", copying={node.copies_in_flight}" if node.copies_in_flight else ""
    return (
        f"[{label(node, max_tokens_shown)}] {node.num_tokens} tok, {node.residency}, "
        f"pages [{page_list(node.pages)}], host [{page_list(node.host_pages)}], "
        f"lock={node.lock_ref}, t={node.last_access}, hits={node.hit_count}{flight}"
    )


def residency_decoration(node: TreeNode) -> tuple[str, str]:
    """``render_dot``'s decoration for a cache with a host tier: the node's residency, and
    grey with a dotted border for a node held in host memory only."""
    style = ', style="filled,dotted", fillcolor="#dddddd"' if not node.on_device else ""
    return node.residency, style


def render_text(
    root: TreeNode,
    header: str,
    max_tokens_shown: int = 8,
    line: Callable[[TreeNode, int], str] = node_line,
) -> str:
    """``header``, then one line per node under ``root``, indented by depth: ``line(node,
    max_tokens_shown)`` (``node_line`` by default; a cache with a host tier passes its own,
    which also says where the node lives)."""
    lines = [header]

    def walk(node: TreeNode, indent: str) -> None:
        kids = _sorted_children(node)
        for i, c in enumerate(kids):
            last = i == len(kids) - 1
            branch = "└─ " if last else "├─ "
            text = f"namespace {c.namespace!r}" if not c.key else line(c, max_tokens_shown)
            lines.append(indent + branch + text)
            walk(c, indent + ("   " if last else "│  "))

    walk(root, "")
    return "\n".join(lines)


def render_dot(
    nodes: Iterable[TreeNode],
    evictable: Iterable[TreeNode],
    max_tokens_shown: int = 6,
    decorate: Callable[[TreeNode], tuple[str, str]] | None = None,
) -> str:
    """Graphviz source for ``nodes`` (a whole trie, root first): one box per node; locked nodes
    are filled, the ``evictable`` leaves dashed. ``decorate(node)`` (a cache with a host tier
    passes one) gives a line to add to a node's label and a style that replaces the dashed
    one ("" for none): where the node lives, and grey for nodes held in host memory only."""
    out = ["digraph radix {", '  node [shape=box, fontname="monospace", fontsize=10];']
    dashed = {n.node_id for n in evictable}
    for node in nodes:
        extra = ("", "")
        if node.parent is None:
            label_ = "root"
        elif not node.key:
            label_ = f"namespace {node.namespace!r}"
        else:
            label_ = (
                f"{label(node, max_tokens_shown)}\\n{node.num_tokens} tok / "
                f"{node.num_pages} pages\\nlock={node.lock_ref} t={node.last_access}"
            )
            if decorate is not None:
                extra = decorate(node)
                label_ += f"\\n{extra[0]}"
        label_ = label_.replace('"', '\\"')
        style = ""
        if node.lock_ref > 0:
            style = ', style=filled, fillcolor="#ffd28a"'
        elif extra[1]:
            style = extra[1]
        elif node.node_id in dashed:
            style = ", style=dashed"
        out.append(f'  n{node.node_id} [label="{label_}"{style}];')
        if node.parent is not None:
            out.append(f"  n{node.parent.node_id} -> n{node.node_id};")
    out.append("}")
    return "\n".join(out)
