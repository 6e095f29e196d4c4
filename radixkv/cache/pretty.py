"""Text and Graphviz renderings of a RadixCache trie (for debugging, docs and notebooks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixkv.cache.node import TreeNode

if TYPE_CHECKING:
    from radixkv.cache.radix_cache import RadixCache


def _label(node: TreeNode, max_tokens_shown: int) -> str:
    toks = node.tokens
    shown = " ".join(map(str, toks[:max_tokens_shown]))
    if len(toks) > max_tokens_shown:
        shown += f" ...(+{len(toks) - max_tokens_shown})"
    return shown


def _sorted_children(node: TreeNode) -> list[TreeNode]:
    return sorted(node.iter_children(), key=lambda c: (c.key == b"", c.key[:64], c._id))


def pretty(cache: RadixCache, max_tokens_shown: int = 8) -> str:
    """One line per node, indented by depth: tokens, pages, lock count, access time, hits."""
    lines = [
        f"root  [{cache.num_cached_pages} cached pages, {cache.num_locked_pages} locked, "
        f"{cache.pool.num_free} free, policy={cache.policy.name}, page_size={cache.page_size}]"
    ]

    def walk(node: TreeNode, indent: str) -> None:
        kids = _sorted_children(node)
        for i, c in enumerate(kids):
            last = i == len(kids) - 1
            branch = "└─ " if last else "├─ "
            if not c.key:
                text = f"namespace {c.namespace!r}"
            else:
                pages = c._pages
                ptxt = ",".join(map(str, pages[:4])) + (",..." if len(pages) > 4 else "")
                text = (
                    f"[{_label(c, max_tokens_shown)}] {c.num_tokens} tok, pages [{ptxt}], "
                    f"lock={c.lock_ref}, t={c.last_access}, hits={c.hit_count}"
                )
            lines.append(indent + branch + text)
            walk(c, indent + ("   " if last else "│  "))

    walk(cache.root, "")
    return "\n".join(lines)


def to_dot(cache: RadixCache, max_tokens_shown: int = 6) -> str:
    """Graphviz source: one box per node; locked nodes are filled, evictable leaves dashed."""
    out = ["digraph radix {", '  node [shape=box, fontname="monospace", fontsize=10];']
    evictable = {n._id for n in cache.eviction_order()}
    for node in cache.iter_nodes():
        if node is cache.root:
            label = "root"
        elif not node.key:
            label = f"namespace {node.namespace!r}"
        else:
            label = (
                f"{_label(node, max_tokens_shown)}\\n{node.num_tokens} tok / "
                f"{len(node._pages)} pages\\nlock={node.lock_ref} t={node.last_access}"
            )
        label = label.replace('"', '\\"')
        style = ""
        if node.lock_ref > 0:
            style = ', style=filled, fillcolor="#ffd28a"'
        elif node._id in evictable:
            style = ", style=dashed"
        out.append(f'  n{node._id} [label="{label}"{style}];')
        if node.parent is not None:
            out.append(f"  n{node.parent._id} -> n{node._id};")
    out.append("}")
    return "\n".join(out)
