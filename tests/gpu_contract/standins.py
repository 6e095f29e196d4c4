"""Recording stand-ins for the real ``flashinfer`` module, for the CPU contract tests.

:class:`FakeFlashInfer` offers the names radixkv's FlashInfer backends use
(``BatchPrefillWithPagedKVCacheWrapper``, ``BatchDecodeWithPagedKVCacheWrapper``,
``MultiLevelCascadeAttentionWrapper``, ``merge_state``, ``merge_state_in_place``). Every
constructor, ``plan``, ``run`` and function call is

1. bound to ``inspect.signature`` of the real class's method or the real function (wrong names,
   missing required arguments, too many positionals fail); arguments that would land in a
   catch-all ``*args`` (FlashInfer's deprecated positional options) fail, and ``**kwargs`` are
   bound to the keyword-only signature of the method that receives them (the decode wrapper's
   ``plan`` forwards them to ``_plan_impl``);
2. checked against the real annotations (``torch.Tensor``, ``int``, ``float``, ``bool``, ``str``,
   ``Optional``/``Union``) and against what FlashInfer documents and the GPU kit relies on:
   int32 page metadata (the kit's kernels are compiled for int32 indices), indptr and last
   page lengths on the CPU and page indices on the device (no device-to-host copies in
   ``plan``), ``1 <= last_page_len <= page_size``, consistent CSR lengths, causal query counts
   within the KV length, zeroed uint8 workspaces, q/KV dtypes as planned, NHD caches
   ``[pages, page_size, Hkv, D]`` with equal K and V strides (else FlashInfer needs its
   independent-stride kernel, which the kit does not carry), float32 LSEs, ``plan`` before ``run``;
3. recorded (``calls``), and, when tensors have values (device ``cpu``), computed with the
   documented maths in float32 (bottom-right aligned causal mask, base-2 LSE), so the
   backends' outputs can be compared with the torch backend. With device ``meta`` nothing is
   computed (outputs are empty tensors of the right shape) but CPU-vs-device placement is
   visible.
"""

from __future__ import annotations

import inspect
import itertools
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import torch

HALF = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 256)  # what FlashInfer instantiates for prefill and decode
LN2 = math.log(2.0)


class ContractError(AssertionError):
    """A call radixkv made that the real FlashInfer API does not accept (or documents against)."""


@dataclass
class Call:
    name: str
    args: dict[str, Any]


@dataclass
class Recorder:
    calls: list[Call] = field(default_factory=list)

    def names(self) -> list[str]:
        return [c.name for c in self.calls]

    def count(self, name: str) -> int:
        return sum(1 for c in self.calls if c.name == name)


# ------------------------------------------------------------------------------------------------
# binding and type checks against the real API
def _type_ok(value: Any, ann: Any) -> bool:
    if ann is inspect.Parameter.empty or ann is Any:
        return True
    if isinstance(ann, str):  # postponed annotation: only the common spellings
        ann = {"torch.Tensor": torch.Tensor, "int": int, "float": float, "bool": bool}.get(ann)
        if ann is None:
            return True
    origin = typing.get_origin(ann)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(ann))
    if ann is type(None):
        return value is None
    if origin in (list, tuple, typing.List, typing.Tuple):  # noqa: UP006
        return isinstance(value, (list, tuple))
    if origin is not None:
        return True
    if ann is bool:
        return isinstance(value, bool)
    if ann is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if ann is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if ann is torch.dtype:
        return isinstance(value, torch.dtype)
    if isinstance(ann, type):
        return isinstance(value, ann)
    return True


# Where FlashInfer's docstrings are wider than its annotations (documented types win).
DOCUMENTED_TYPES: dict[str, Any] = {
    "q_data_type": str | torch.dtype,
    "kv_data_type": str | torch.dtype | None,
    # MultiLevelCascadeAttentionWrapper.run annotates a Tensor; its docstring takes a (k, v) tuple
    "paged_kv_cache": torch.Tensor | tuple,
}


def bind(
    name: str,
    real: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    method: bool,
    kwargs_target: Any = None,
) -> dict[str, Any]:
    """Bind a call to the real callable's signature; return every parameter's effective value."""
    sig = inspect.signature(real)
    lead = (object(),) if method else ()
    try:
        bound = sig.bind(*lead, *args, **kwargs)
    except TypeError as exc:
        raise ContractError(f"{name}: {exc} (real signature {sig})") from None
    values: dict[str, Any] = {}
    for pname, p in sig.parameters.items():
        if p.kind is p.VAR_POSITIONAL and bound.arguments.get(pname):
            raise ContractError(
                f"{name}: {len(bound.arguments[pname])} argument(s) passed positionally past "
                f"the named ones; FlashInfer takes these by keyword (deprecated positional use)"
            )
    extra = {}
    for pname, p in sig.parameters.items():
        if p.kind is p.VAR_KEYWORD:
            extra = dict(bound.arguments.get(pname, {}))
    bound.apply_defaults()
    for pname, p in sig.parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or (method and pname == "self"):
            continue
        values[pname] = bound.arguments[pname]
        _check_type(name, pname, values[pname], p.annotation)
    if extra:
        if kwargs_target is None:
            raise ContractError(f"{name}: unexpected keyword arguments {sorted(extra)}")
        tsig = inspect.signature(kwargs_target)
        allowed = {
            n: q
            for n, q in tsig.parameters.items()
            if q.kind in (q.KEYWORD_ONLY, q.POSITIONAL_OR_KEYWORD) and n not in values
        }
        unknown = sorted(set(extra) - set(allowed))
        if unknown:
            raise ContractError(
                f"{name}: unknown keyword argument(s) {unknown}; "
                f"{kwargs_target.__qualname__} takes {sorted(allowed)}"
            )
        for n, q in allowed.items():
            if n == "self":
                continue
            values[n] = extra.get(n, q.default)
            if n in extra:
                _check_type(name, n, extra[n], q.annotation)
    return values


def _check_type(name: str, pname: str, value: Any, ann: Any) -> None:
    ann = DOCUMENTED_TYPES.get(pname, ann)
    if not _type_ok(value, ann):
        raise ContractError(f"{name}: {pname}={_show(value)} is not {ann}")


def _show(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype}, device={x.device})"
    return repr(x)


def _need(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ContractError(f"{name}: {msg}")


def _has_values(t: torch.Tensor) -> bool:
    return t.device.type != "meta"


# ------------------------------------------------------------------------------------------------
# the stand-in module
class FakeFlashInfer(types.ModuleType):
    """A ``flashinfer`` stand-in bound to the real module ``real``; ``device`` plays the GPU."""

    def __init__(self, real: Any, device: torch.device | str) -> None:
        super().__init__("flashinfer")
        self.real = real
        self.device = torch.device(device)
        self.recorder = Recorder()
        self.__version__ = getattr(real, "__version__", "?")
        fake = self

        class _Prefill(_PrefillStandIn):
            _fake = fake

        class _Decode(_DecodeStandIn):
            _fake = fake

        class _Multi(_MultiStandIn):
            _fake = fake

        self.BatchPrefillWithPagedKVCacheWrapper = _Prefill
        self.BatchDecodeWithPagedKVCacheWrapper = _Decode
        self.MultiLevelCascadeAttentionWrapper = _Multi

    # -- tensor placement helpers
    def on_device(self, name: str, what: str, t: torch.Tensor) -> None:
        _need(
            t.device == self.device,
            name,
            f"{what} must be on the GPU ({self.device}), is on {t.device}",
        )

    def on_cpu(self, name: str, what: str, t: torch.Tensor) -> None:
        _need(
            t.device.type == "cpu",
            name,
            f"{what} should be a CPU tensor (FlashInfer copies it to the host in plan; a device "
            f"tensor costs a device-to-host sync every step), is on {t.device}",
        )

    def record(self, name: str, values: dict[str, Any]) -> None:
        self.recorder.calls.append(Call(name, values))

    # -- merge functions
    def _state_checks(self, name: str, v: torch.Tensor, s: torch.Tensor, tag: str) -> None:
        _need(
            v.dim() == 3, name, f"{tag} output must be [n, heads, head_dim], got {tuple(v.shape)}"
        )
        _need(v.dtype in HALF, name, f"{tag} output must be fp16/bf16, got {v.dtype}")
        _need(s.dtype == torch.float32, name, f"{tag} LSE must be float32, got {s.dtype}")
        _need(
            tuple(s.shape) == tuple(v.shape[:2]),
            name,
            f"{tag} LSE shape {tuple(s.shape)} != {tuple(v.shape[:2])}",
        )
        self.on_device(name, f"{tag} output", v)
        self.on_device(name, f"{tag} LSE", s)
        _need(v.is_contiguous() and s.is_contiguous(), name, f"{tag} state must be contiguous")

    def merge_state(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        name = "merge_state"
        a = bind(name, self.real.merge_state, args, kwargs, method=False)
        self._state_checks(name, a["v_a"], a["s_a"], "a")
        self._state_checks(name, a["v_b"], a["s_b"], "b")
        _need(a["v_a"].shape == a["v_b"].shape, name, "v_a and v_b differ in shape")
        _need(a["v_a"].dtype == a["v_b"].dtype, name, "v_a and v_b differ in dtype")
        self.record(name, a)
        return _merge(a["v_a"], a["s_a"], a["v_b"], a["s_b"])

    def merge_state_in_place(self, *args: Any, **kwargs: Any) -> None:
        name = "merge_state_in_place"
        a = bind(name, self.real.merge_state_in_place, args, kwargs, method=False)
        self._state_checks(name, a["v"], a["s"], "v")
        self._state_checks(name, a["v_other"], a["s_other"], "other")
        _need(a["v"].shape == a["v_other"].shape, name, "v and v_other differ in shape")
        _need(a["mask"] is None, name, "radixkv passes no mask")
        self.record(name, a)
        v, s = _merge(a["v"], a["s"], a["v_other"], a["s_other"])
        a["v"].copy_(v)
        a["s"].copy_(s)


def _merge(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's merge of two (output, base-2 LSE) states; an empty state has LSE -inf."""
    if not _has_values(v_a):
        return torch.empty_like(v_a), torch.empty_like(s_a)
    m = torch.maximum(s_a, s_b)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp2(s_a - m), torch.exp2(s_b - m)
    d = wa + wb
    safe = torch.where(d > 0, d, torch.ones_like(d))
    v = (v_a.float() * (wa / safe)[..., None] + v_b.float() * (wb / safe)[..., None]).to(v_a.dtype)
    return v, torch.log2(d) + m


# ------------------------------------------------------------------------------------------------
# wrappers
class _WrapperStandIn:
    _fake: FakeFlashInfer
    real_name = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        name = f"{self.real_name}.__init__"
        a = bind(name, self._real_cls().__init__, args, kwargs, method=True)
        self._init_checks(name, a)
        _need(
            a["backend"] == "fa2",
            name,
            f"radixkv pins FA2 kernels (the kit compiles those), backend={a['backend']!r}",
        )
        self._fake.record(name, a)

    def _real_cls(self) -> Any:
        return getattr(self._fake.real, self.real_name)

    def _init_checks(self, name: str, a: dict[str, Any]) -> None:
        fake = self._fake
        ws = a["float_workspace_buffer"]
        _need(
            ws.dtype == torch.uint8 and ws.dim() == 1,
            name,
            f"workspace must be a 1-D uint8 tensor, got {_show(ws)}",
        )
        fake.on_device(name, "float_workspace_buffer", ws)
        _need(
            ws.numel() >= 16 * 1024 * 1024,
            name,
            f"workspace of {ws.numel()} bytes is small (FlashInfer recommends 128 MB)",
        )
        if _has_values(ws):
            _need(
                bool((ws == 0).all()),
                name,
                "the float workspace must be zero-initialised before its first use",
            )
        _need(
            a["kv_layout"] == "NHD", name, f"radixkv's caches are NHD, kv_layout={a['kv_layout']!r}"
        )
        _need(
            a["use_cuda_graph"] is False,
            name,
            "CUDA graphs need the *_buf arguments; radixkv does not use them",
        )
        self._planned: dict[str, Any] | None = None

    def _csr_checks(
        self,
        name: str,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last: torch.Tensor,
        page_size: int,
    ) -> list[int]:
        fake = self._fake
        for what, t in (("kv indptr", indptr), ("page indices", indices), ("last_page_len", last)):
            _need(
                isinstance(t, torch.Tensor) and t.dim() == 1, name, f"{what} must be a 1-D tensor"
            )
            _need(
                t.dtype == torch.int32,
                name,
                f"{what} must be int32 (the kit's kernels use int32 indices), got {t.dtype}",
            )
        fake.on_cpu(name, "kv indptr", indptr)
        fake.on_cpu(name, "last_page_len", last)
        fake.on_device(name, "page indices", indices)
        ip = indptr.tolist()
        _need(
            len(ip) == len(last) + 1,
            name,
            f"kv indptr has {len(ip)} entries for {len(last)} requests",
        )
        _need(
            ip[0] == 0 and all(b >= a for a, b in itertools.pairwise(ip)),
            name,
            f"kv indptr {ip[:8]}... must start at 0 and not decrease",
        )
        _need(
            indices.numel() == ip[-1],
            name,
            f"{indices.numel()} page indices but kv indptr ends at {ip[-1]}",
        )
        lp = last.tolist()
        _need(
            all(1 <= x <= page_size for x in lp),
            name,
            f"last_page_len must be in [1, {page_size}], got {lp[:8]}...",
        )
        _need(
            all(b > a for a, b in itertools.pairwise(ip)),
            name,
            "every request needs at least one page",
        )
        return [(ip[i + 1] - ip[i] - 1) * page_size + lp[i] for i in range(len(lp))]

    def _common_plan_checks(self, name: str, a: dict[str, Any], head_dim: int) -> None:
        hq, hkv = a["num_qo_heads"], a["num_kv_heads"]
        _need(
            hq > 0 and hkv > 0 and hq % hkv == 0,
            name,
            f"num_qo_heads {hq} must be a multiple of num_kv_heads {hkv}",
        )
        _need(
            head_dim in HEAD_DIMS,
            name,
            f"head_dim {head_dim} is not one FlashInfer compiles ({HEAD_DIMS})",
        )
        _need(a["page_size"] >= 1, name, "page_size must be >= 1")
        _need(
            a["q_data_type"] in HALF,
            name,
            f"q_data_type must be torch.float16/bfloat16, got {a['q_data_type']!r}",
        )
        kv = a["kv_data_type"] if a["kv_data_type"] is not None else a["q_data_type"]
        _need(kv in HALF, name, f"kv_data_type must be fp16/bf16, got {kv!r}")
        _need(
            a["pos_encoding_mode"] == "NONE",
            name,
            "radixkv applies RoPE itself: pos_encoding_mode must be 'NONE'",
        )
        cap = a.get("logits_soft_cap")
        _need(
            cap is None or (isinstance(cap, float) and cap > 0),
            name,
            f"logits_soft_cap must be None or a positive float, got {cap!r}",
        )
        wl = a.get("window_left", -1)
        _need(
            isinstance(wl, int) and wl >= -1, name, f"window_left must be an int >= -1, got {wl!r}"
        )
        sm = a["sm_scale"]
        _need(
            sm is None or (isinstance(sm, float) and sm > 0),
            name,
            f"sm_scale must be a positive float, got {sm!r}",
        )

    def _run_checks(
        self, name: str, a: dict[str, Any], rows: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        fake, p = self._fake, self._planned
        _need(p is not None, name, "run() before plan()")
        assert p is not None
        q, cache = a["q"], a["paged_kv_cache"]
        _need(
            isinstance(cache, tuple) and len(cache) == 2,
            name,
            "radixkv passes the cache as a (k_cache, v_cache) tuple",
        )
        k, v = cache
        fake.on_device(name, "q", q)
        fake.on_device(name, "k_cache", k)
        fake.on_device(name, "v_cache", v)
        _need(
            q.dim() == 3 and tuple(q.shape[1:]) == (p["num_qo_heads"], p["head_dim"]),
            name,
            f"q must be [{rows}, {p['num_qo_heads']}, {p['head_dim']}], got {tuple(q.shape)}",
        )
        _need(q.shape[0] == rows, name, f"q has {q.shape[0]} rows, the plan has {rows}")
        _need(
            q.dtype == p["q_data_type"],
            name,
            f"q is {q.dtype}, planned q_data_type {p['q_data_type']}",
        )
        # the kernels take q's row and head strides; its last dimension must be packed
        _need(q.stride(-1) == 1, name, "q's last dimension must be contiguous")
        kv_dtype = p["kv_data_type"] or p["q_data_type"]
        want = (p["page_size"], p["num_kv_heads"], p["head_dim"])
        for what, t in (("k_cache", k), ("v_cache", v)):
            _need(
                t.dim() == 4 and tuple(t.shape[1:]) == want,
                name,
                f"{what} must be NHD [pages, {want[0]}, {want[1]}, {want[2]}], got {tuple(t.shape)}",
            )
            _need(
                t.dtype == kv_dtype, name, f"{what} is {t.dtype}, planned kv_data_type {kv_dtype}"
            )
            _need(t.stride(-1) == 1, name, f"{what}'s last dimension must be contiguous")
        _need(k.shape == v.shape, name, "k_cache and v_cache differ in shape")
        _need(
            k.stride() == v.stride(),
            name,
            "k_cache and v_cache strides differ: FlashInfer then loads its independent-stride "
            "kernel, which the GPU kit does not carry",
        )
        if _has_values(p["indices"]) and p["indices"].numel():
            _need(
                int(p["indices"].max()) < k.shape[0],
                name,
                "a page index is past the end of the cache",
            )
        _need(
            a.get("out") is None and a.get("lse") is None,
            name,
            "radixkv lets FlashInfer allocate out/lse",
        )
        return q, k, v

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        qo: list[int],
        causal: bool,
        return_lse: bool,
        lse_base: str,
    ) -> Any:
        """The documented maths, in float32: per request, its pages in order, bottom-right causal."""
        p = self._planned
        assert p is not None
        hq, hkv, d = p["num_qo_heads"], p["num_kv_heads"], p["head_dim"]
        out = torch.empty(q.shape, dtype=p["q_data_type"], device=q.device)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        if _has_values(q):
            scale = p["sm_scale"] if p["sm_scale"] is not None else d**-0.5
            ps, ip, idx = p["page_size"], p["indptr"].tolist(), p["indices"].tolist()
            for i, n_kv in enumerate(p["kv_lens"]):
                pages = idx[ip[i] : ip[i + 1]]
                slots = torch.tensor([pages[t // ps] * ps + t % ps for t in range(n_kv)])
                kk = k.reshape(-1, hkv, d)[slots].float().repeat_interleave(hq // hkv, dim=1)
                vv = v.reshape(-1, hkv, d)[slots].float().repeat_interleave(hq // hkv, dim=1)
                qq = q[qo[i] : qo[i + 1]].float()  # [n_q, Hq, D]
                s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
                if p.get("logits_soft_cap"):  # cap * tanh(scaled score / cap)
                    s = torch.tanh(s / p["logits_soft_cap"]) * p["logits_soft_cap"]
                n_q = qq.shape[0]
                pos = (n_kv - n_q + torch.arange(n_q))[:, None]  # bottom-right aligned
                keys = torch.arange(n_kv)[None, :]
                seen = torch.ones(n_q, n_kv, dtype=torch.bool)
                if causal:
                    _need(
                        n_q <= n_kv, "run", f"causal request {i} has {n_q} queries over {n_kv} keys"
                    )
                    seen &= keys <= pos
                if p.get("window_left", -1) >= 0:  # keys pos - window_left .. pos
                    seen &= keys >= pos - p["window_left"]
                s = s.masked_fill(~seen[None], float("-inf"))
                out[qo[i] : qo[i + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv).to(
                    out.dtype
                )
                nat = torch.logsumexp(s, -1).transpose(0, 1)  # [n_q, Hq]
                lse[qo[i] : qo[i + 1]] = nat / LN2 if lse_base == "log2" else nat
        return (out, lse) if return_lse else out


class _PrefillStandIn(_WrapperStandIn):
    real_name = "BatchPrefillWithPagedKVCacheWrapper"

    def plan(self, *args: Any, **kwargs: Any) -> None:
        name = f"{self.real_name}.plan"
        a = bind(name, self._real_cls().plan, args, kwargs, method=True)
        d = a["head_dim_qk"]
        _need(a["head_dim_vo"] in (None, d), name, "head_dim_vo must equal head_dim_qk")
        self._common_plan_checks(name, a, d)
        qo = a["qo_indptr"]
        _need(
            isinstance(qo, torch.Tensor) and qo.dim() == 1 and qo.dtype == torch.int32,
            name,
            f"qo_indptr must be 1-D int32, got {_show(qo)}",
        )
        self._fake.on_cpu(name, "qo_indptr", qo)
        kv_lens = self._csr_checks(
            name,
            a["paged_kv_indptr"],
            a["paged_kv_indices"],
            a["paged_kv_last_page_len"],
            a["page_size"],
        )
        q_ip = qo.tolist()
        _need(
            len(q_ip) == len(kv_lens) + 1 and q_ip[0] == 0,
            name,
            "qo_indptr must have batch+1 entries from 0",
        )
        n_q = [b - a_ for a_, b in itertools.pairwise(q_ip)]
        _need(all(x >= 1 for x in n_q), name, f"every request needs a query row, got {n_q[:8]}...")
        if a["causal"]:
            _need(
                all(x <= y for x, y in zip(n_q, kv_lens)),
                name,
                "a causal request has more queries than keys",
            )
        _need(a["custom_mask"] is None and a["packed_custom_mask"] is None, name, "no custom masks")
        self._planned = {
            "num_qo_heads": a["num_qo_heads"], "num_kv_heads": a["num_kv_heads"], "head_dim": d,
            "page_size": a["page_size"], "q_data_type": a["q_data_type"], "kv_data_type": a["kv_data_type"],
            "sm_scale": a["sm_scale"], "causal": a["causal"], "qo": q_ip, "kv_lens": kv_lens,
            "indptr": a["paged_kv_indptr"], "indices": a["paged_kv_indices"],
            "window_left": a.get("window_left", -1), "logits_soft_cap": a.get("logits_soft_cap"),
        }  # fmt: skip
        self._fake.record(name, a)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        name = f"{self.real_name}.run"
        a = bind(name, self._real_cls().run, args, kwargs, method=True)
        p = self._planned
        _need(p is not None, name, "run() before plan()")
        assert p is not None
        q, k, v = self._run_checks(name, a, p["qo"][-1])
        _need(
            a.get("lse_layout", "NH") == "NH",
            name,
            "radixkv reads LSE as [rows, heads] (lse_layout 'NH')",
        )
        self._fake.record(name, a)
        # releases before lse_base existed return base 2
        return self._attend(
            q, k, v, p["qo"], p["causal"], a["return_lse"], a.get("lse_base", "log2")
        )


class _DecodeStandIn(_WrapperStandIn):
    real_name = "BatchDecodeWithPagedKVCacheWrapper"

    def plan(self, *args: Any, **kwargs: Any) -> None:
        name = f"{self.real_name}.plan"
        cls = self._real_cls()
        a = bind(name, cls.plan, args, kwargs, method=True, kwargs_target=cls._plan_impl)
        self._common_plan_checks(name, a, a["head_dim"])
        _need(
            a.get("data_type") is None,
            name,
            "data_type is deprecated: pass q_data_type/kv_data_type",
        )
        _need(a.get("q_len_per_req", 1) == 1, name, "one query per request")
        kv_lens = self._csr_checks(
            name, a["indptr"], a["indices"], a["last_page_len"], a["page_size"]
        )
        self._planned = {
            "num_qo_heads": a["num_qo_heads"], "num_kv_heads": a["num_kv_heads"], "head_dim": a["head_dim"],
            "page_size": a["page_size"], "q_data_type": a["q_data_type"], "kv_data_type": a["kv_data_type"],
            "sm_scale": a["sm_scale"], "qo": list(range(len(kv_lens) + 1)), "kv_lens": kv_lens,
            "indptr": a["indptr"], "indices": a["indices"],
            "window_left": a.get("window_left", -1), "logits_soft_cap": a.get("logits_soft_cap"),
        }  # fmt: skip
        self._fake.record(name, a)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        name = f"{self.real_name}.run"
        a = bind(name, self._real_cls().run, args, kwargs, method=True)
        p = self._planned
        _need(p is not None, name, "run() before plan()")
        assert p is not None
        q, k, v = self._run_checks(name, a, len(p["kv_lens"]))
        _need(a.get("q_len_per_req") in (None, 1), name, "one query per request")
        self._fake.record(name, a)
        return self._attend(q, k, v, p["qo"], False, a["return_lse"], "log2")


class _MultiStandIn:
    """FlashInfer's ``MultiLevelCascadeAttentionWrapper``: one prefill wrapper per level (causal
    only at the last), run as the real one runs (last level, the others merged in place). Its
    per-level wrappers are deliberately not at the real class's private attribute names: code
    that reaches into them fails here."""

    _fake: FakeFlashInfer
    real_name = "MultiLevelCascadeAttentionWrapper"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        name = f"{self.real_name}.__init__"
        real = getattr(self._fake.real, self.real_name)
        a = bind(name, real.__init__, args, kwargs, method=True)
        n = a["num_levels"]
        _need(isinstance(n, int) and n >= 1, name, f"num_levels must be a positive int, got {n!r}")
        _need(a["use_cuda_graph"] is False, name, "radixkv does not use CUDA graphs")
        self._levels = [
            self._fake.BatchPrefillWithPagedKVCacheWrapper(
                a["float_workspace_buffer"], a["kv_layout"], backend="fa2"
            )
            for _ in range(n)
        ]
        self._fake.record(name, a)

    def plan(self, *args: Any, **kwargs: Any) -> None:
        name = f"{self.real_name}.plan"
        real = getattr(self._fake.real, self.real_name)
        a = bind(name, real.plan, args, kwargs, method=True)
        arrays = (
            "qo_indptr_arr",
            "paged_kv_indptr_arr",
            "paged_kv_indices_arr",
            "paged_kv_last_page_len",
        )
        for arr in arrays:
            _need(
                len(a[arr]) == len(self._levels),
                name,
                f"{arr} has {len(a[arr])} entries for {len(self._levels)} levels",
            )
        self._fake.record(name, a)
        for i, w in enumerate(self._levels):
            w.plan(  # type: ignore[attr-defined]
                *(a[arr][i] for arr in arrays), a["num_qo_heads"], a["num_kv_heads"], a["head_dim"], a["page_size"],
                causal=a["causal"] if i == len(self._levels) - 1 else False,
                pos_encoding_mode=a["pos_encoding_mode"], sm_scale=a["sm_scale"],
                q_data_type=a["q_data_type"], kv_data_type=a["kv_data_type"],
            )  # fmt: skip

    def run(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        name = f"{self.real_name}.run"
        real = getattr(self._fake.real, self.real_name)
        a = bind(name, real.run, args, kwargs, method=True)
        self._fake.record(name, a)
        out, lse = self._levels[-1].run(a["q"], a["paged_kv_cache"], return_lse=True)  # type: ignore[attr-defined]
        for w in self._levels[:-1]:
            o_i, s_i = w.run(a["q"], a["paged_kv_cache"], return_lse=True)  # type: ignore[attr-defined]
            self._fake.merge_state_in_place(out, lse, o_i, s_i)
        return out
