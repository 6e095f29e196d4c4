"""The FlashInfer cascade module on a CPU-only machine: imports without flashinfer, and its
per-level decomposition (rows that read nothing at a level are left out of that level) is exact
when each level is run by the torch kernel. The GPU itself is checked by bench/gpu_check.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from cascade_helpers import level, random_kv, reference_decode

from radixkv.attention.cascade import CascadePlan, TorchCascadeAttention, merge_state
from radixkv.attention.cascade_flashinfer import FlashInferCascadeAttention, _compact


def test_module_imports_without_flashinfer_and_rejects_cpu() -> None:
    if importlib.util.find_spec("flashinfer") is None:
        with pytest.raises(ImportError):
            FlashInferCascadeAttention("cpu")
    else:  # pragma: no cover - only where flashinfer is installed
        with pytest.raises(ValueError, match="CUDA"):
            FlashInferCascadeAttention("cpu")


def test_per_level_compaction_is_exact() -> None:
    ps, h_q, h_kv, d = 4, 4, 2, 8
    k, v = random_kv(64, ps, h_kv, d, seed=7)
    trunk, a = [3, 9], [12]
    # rows 0,1 read trunk + a; row 2 reads trunk only; row 3 nothing shared
    tables = [[*trunk, *a, 20], [*trunk, *a, 21], [*trunk, 22], [23, 24]]
    lens = [13, 14, 10, 6]
    lv0 = level(ps, [(3, trunk, 8), (1, [], 0)])
    lv1 = level(ps, [(2, a, 4), (2, [], 0)])
    own = level(ps, [(1, [20], 1), (1, [21], 2), (1, [22], 2), (1, [23, 24], 6)])
    plan = CascadePlan(ps, 4, (lv0, lv1, own))
    q = torch.randn(4, h_q, d)
    o = torch.zeros(4, h_q, d)
    s = torch.full((4, h_q), float("-inf"))
    for lvl in plan.levels:  # what FlashInferCascadeAttention does per level, on torch
        rows, compact = _compact(lvl)
        assert compact.qo_indptr[-1] == len(rows)
        assert all(x > 0 for x in compact.kv_last_page_len)
        sub = CascadePlan(ps, len(rows), (compact,))
        o_i, s_i = TorchCascadeAttention(sub).forward(q[rows], k, v, return_lse=True)
        o[rows], s[rows] = merge_state(o[rows], s[rows], o_i.float(), s_i)
    ref = reference_decode(q, k, v, tables, lens)
    assert (o.double() - ref).abs().max().item() <= 1e-5
    assert _compact(lv1)[0] == [0, 1]
