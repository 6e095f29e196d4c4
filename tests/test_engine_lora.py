"""LoRA adapters in the engine: mixed batches of the base model and several adapters, each
request's greedy tokens equal to PEFT's; an adapter's KV cached apart; loading, unloading and
the errors of both; fork, sessions, streaming, speculative decoding with an adapter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _model_hf_builders import EOS_ID, hf_greedy
from engine_helpers import STEP_CONFIGS, make_small_llama, shared_prefix_prompts
from lora_helpers import ATTN, make_peft_adapter, peft_greedy

from radixkv.engine.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.lora import AdapterNamespace
from radixkv.engine.params import SamplingParams
from radixkv.model.errors import ModelLoadError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("engine-lora")
    hf, lm = make_small_llama(root / "base")
    folders = {"sql": root / "sql", "chat": root / "chat"}
    refs = {
        None: hf,
        "sql": make_peft_adapter(hf, folders["sql"], seed=11),
        "chat": make_peft_adapter(hf, folders["chat"], seed=12, r=4, target_modules=ATTN),
    }
    return {"lm": lm, "folders": folders, "refs": refs, "expected": {}}


def _expected(setup: dict[str, Any], lora: str | None, prompt: list[int]) -> list[int]:
    """PEFT's (or, for the base model, transformers') greedy tokens, memoised."""
    key = (lora, tuple(prompt))
    memo = setup["expected"]
    if key not in memo:
        ref = setup["refs"][lora]
        memo[key] = (
            hf_greedy(ref, prompt, GREEDY.max_tokens)
            if lora is None
            else peft_greedy(ref, prompt, GREEDY.max_tokens, EOS_ID)
        )
    return memo[key]


def _engine(setup: dict[str, Any], **kw: Any) -> Engine:
    kw.setdefault("page_size", 4)
    kw.setdefault("num_pages", 400)
    folders = setup["folders"]
    return Engine(setup["lm"], lora_modules={n: str(f) for n, f in folders.items()}, **kw)


def _run_checked(eng: Engine, requests: list[tuple[list[int], str | None]]) -> list[Any]:
    """Submit every (prompt, adapter), step to the end checking invariants after each step."""
    ids = [eng.add_request(p, GREEDY, stream=False, lora=name) for p, name in requests]
    done: dict[str, Any] = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        eng.check_invariants()
    eng.check_invariants()
    return [done[i] for i in ids]


@pytest.mark.parametrize("cfg", STEP_CONFIGS)
def test_mixed_batches_match_peft(setup: dict[str, Any], cfg: dict[str, Any]) -> None:
    """The same prompts under the base model and two adapters, all submitted together (so
    batches mix them, with prefixes shared inside each), equal their references token for token."""
    eng = _engine(setup, **cfg)
    prompts = shared_prefix_prompts(5, n=6)
    names = [None, "sql", "chat"]
    requests = [(p, names[(i + j) % 3]) for i, p in enumerate(prompts) for j in range(3)]
    loras = eng.runner.loras
    set_rows, groups_seen = loras.set_rows, []

    def record(*args: Any) -> None:
        set_rows(*args)
        groups_seen.append(loras.groups)

    loras.set_rows = record  # type: ignore[method-assign]
    outs = _run_checked(eng, requests)
    # the scheduler grouped each batch's rows by adapter: one run (a slice) per adapter
    assert any(len(g) == 2 for g in groups_seen)
    assert all(type(rows) is slice for g in groups_seen for _, rows in g)
    for (p, name), o in zip(requests, outs):
        assert o.token_ids == _expected(setup, name, p), (name, p)
        assert o.lora == name
    # the adapters do change the outputs (else equality above would prove little)
    differ = sum(
        _expected(setup, "sql", p) != _expected(setup, None, p)
        and _expected(setup, "chat", p) != _expected(setup, None, p)
        for p in prompts
    )
    assert differ >= len(prompts) // 2


def test_adapter_kv_is_cached_apart(setup: dict[str, Any]) -> None:
    eng = _engine(setup)
    prompt = shared_prefix_prompts(7, n=1)[0] + [9] * 20
    (base,) = eng.generate([prompt], GREEDY, use_tqdm=False)
    (sql,) = eng.generate([prompt], GREEDY, use_tqdm=False, lora="sql")
    assert base.num_cached_tokens == 0 and sql.num_cached_tokens == 0  # nothing shared
    (sql2,) = eng.generate([prompt], GREEDY, use_tqdm=False, lora="sql")
    (chat,) = eng.generate([prompt], GREEDY, use_tqdm=False, lora="chat")
    (tenant,) = eng.generate([prompt], GREEDY, use_tqdm=False, lora="sql", namespace="t1")
    assert sql2.num_cached_tokens >= len(prompt) - 4  # the adapter's own entries hit
    assert chat.num_cached_tokens == 0 and tenant.num_cached_tokens == 0
    assert sql2.token_ids == sql.token_ids == _expected(setup, "sql", prompt)
    digest = {i.name: i.digest for i in eng.list_loras()}
    assert set(eng.cache.namespaces) == {
        AdapterNamespace(digest["sql"]),
        AdapterNamespace(digest["chat"]),
        AdapterNamespace(digest["sql"], "t1"),
    }
    # two names for the same files share one namespace (same content, same KV)
    eng.load_lora("sql-again", setup["folders"]["sql"])
    (again,) = eng.generate([prompt], GREEDY, use_tqdm=False, lora="sql-again")
    assert again.num_cached_tokens >= len(prompt) - 4
    eng.check_invariants()


def test_unload_drops_entries_and_refuses_while_in_use(setup: dict[str, Any]) -> None:
    eng = _engine(setup)
    prompt = shared_prefix_prompts(8, n=1)[0]
    eng.generate([prompt], GREEDY, use_tqdm=False, lora="chat")
    eng.generate([prompt], GREEDY, use_tqdm=False)
    cached = eng.cache.num_cached_pages
    rid = eng.add_request(prompt, GREEDY, lora="sql")
    waiting = eng.add_request(prompt, GREEDY, lora="chat")
    st = eng.stats()
    assert (st.num_lora_adapters, st.running_lora_adapters, st.waiting_lora_adapters) == (
        2,
        [],
        ["chat", "sql"],
    )
    eng.step()
    assert eng.stats().running_lora_adapters == ["chat", "sql"]
    eng.abort(waiting)
    assert eng.stats().running_lora_adapters == ["sql"]
    with pytest.raises(ValueError, match=f"'sql' is in use by request '{rid}'"):
        eng.unload_lora("sql")
    eng.abort(rid)
    sql_ns = AdapterNamespace(next(i.digest for i in eng.list_loras() if i.name == "sql"))
    assert sql_ns in eng.cache.namespaces
    info = eng.unload_lora("sql")
    assert info.name == "sql" and [i.name for i in eng.list_loras()] == ["chat"]
    assert sql_ns not in eng.cache.namespaces  # its pages went back to the pool
    assert eng.cache.num_cached_pages <= cached  # the base and "chat" entries stay
    (again,) = eng.generate([prompt], GREEDY, use_tqdm=False, lora="chat")
    assert again.num_cached_tokens > 0
    with pytest.raises(ValueError, match=r"unknown LoRA adapter 'sql' \(loaded: 'chat'\)"):
        eng.generate([prompt], GREEDY, use_tqdm=False, lora="sql")
    # a request prepared before the unload cannot be submitted after it
    group = eng.prepare(prompt, GREEDY, lora="chat")
    eng.unload_lora("chat")
    with pytest.raises(ValueError, match="'chat' was unloaded"):
        eng.submit(group)
    # loading it again (a new slot) serves it as before
    eng.load_lora("sql", setup["folders"]["sql"])
    (out,) = eng.generate([prompt], GREEDY, use_tqdm=False, lora="sql")
    assert out.token_ids == _expected(setup, "sql", prompt)
    eng.check_invariants()


def test_load_errors_change_nothing(setup: dict[str, Any], tmp_path: Path) -> None:
    eng = _engine(setup)
    with pytest.raises(ValueError, match="'sql' is already loaded"):
        eng.load_lora("sql", setup["folders"]["chat"])
    with pytest.raises(ModelLoadError, match=r"not a LoRA adapter folder \(no such directory\)"):
        eng.load_lora("new", tmp_path / "missing")
    with pytest.raises(ValueError, match="non-empty string"):
        eng.load_lora(" ", setup["folders"]["sql"])
    assert [i.name for i in eng.list_loras()] == ["sql", "chat"]
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        eng.unload_lora("nope")
    with pytest.raises(ValueError, match="2 prompts but 3 LoRA adapter names"):
        eng.generate([[5, 6], [7, 8]], GREEDY, lora=["sql", None, "chat"])
    assert not eng.has_unfinished()


@pytest.mark.parametrize(
    "value, message",
    [
        ("sql", "expected name=path"),
        (["a=/x", "a=/y"], "the name 'a' is given twice"),
        ({"a": ""}, "must be a non-empty string"),
        ([("", "/x")], "non-empty string"),
        ([3], "expected name=path"),
    ],
)
def test_lora_modules_config_is_checked(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(lora_modules=value)


def test_lora_modules_spellings() -> None:
    want = (("a", "/x"), ("b", "/y=z"))
    assert EngineConfig(lora_modules=["a=/x", "b=/y=z"]).lora_modules == want
    assert EngineConfig(lora_modules={"a": "/x", "b": "/y=z"}).lora_modules == want
    assert EngineConfig(lora_modules=[]).lora_modules is None


def test_fork_session_stream_and_speculation_keep_the_adapter(setup: dict[str, Any]) -> None:
    eng = _engine(setup, num_speculative_tokens=3)
    prompt = shared_prefix_prompts(9, n=1)[0]
    want = _expected(setup, "sql", prompt)
    # streaming with prompt-lookup drafts verified in the adapter's forward
    outs = list(eng.stream(prompt, GREEDY, lora="sql"))
    assert outs[-1].token_ids == want and outs[-1].lora == "sql"
    # a fork of a live adapter request continues with the adapter
    rid = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=20), lora="sql")
    for _ in range(4):
        eng.step()
    live = eng._live[rid].seqs[0].token_ids.tolist()
    kids = eng.fork(rid, 2, GREEDY)
    done = {o.request_id: o for o in eng.iter_outputs([rid, *kids]) if o.finished}
    cont = peft_greedy(setup["refs"]["sql"], live, GREEDY.max_tokens, EOS_ID)
    for k in kids:
        assert done[k].lora == "sql" and done[k].token_ids == cont
    # a session pins its state in the adapter's namespace and continues with the adapter
    with eng.session(prompt, lora="chat") as s:
        out = s.generate(GREEDY)
        assert out.token_ids == _expected(setup, "chat", prompt)
        assert s.num_pinned_tokens >= len(prompt) - 4  # pinned in the adapter's namespace
        (branch,) = s.fork(1)
        with branch:
            nxt = branch.generate(GREEDY)
        assert nxt.lora == "chat" and nxt.num_cached_tokens >= s.num_pinned_tokens
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        eng.session(prompt, lora="nope")
    eng.check_invariants()
    assert all(n.lock_ref == 0 for n in eng.cache.iter_nodes() if n.parent is not None)
