"""The engine with a storage tier (EngineConfig.kv_storage): a restarted engine (another process)
hits the prefixes its predecessor computed, two engines on one Valkey server share theirs, a
tenant never loads another's, greedy outputs equal a cold run's every time; and faults (server
down at start, killed mid-run, disk full, permission denied, a corrupt object, a slow store, a
full write queue) each give one warning and a metric while the engine keeps serving."""

from __future__ import annotations

import errno
import logging
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from storage_helpers import ValkeyProcess, free_port

from radixkv.cache.storage import FileStorage
from radixkv.cache.storage.page_format import HEADER_BYTES
from radixkv.cache.tiers import HOST_MEDIUM, WRITE_POLICIES
from radixkv.engine.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.model.loader import LoadedModel, load_model
from radixkv.server.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
OPTS: dict[str, Any] = dict(page_size=4, num_pages=256, host_cache_memory=2_000_000)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("radixkv-tiny")


@pytest.fixture(scope="module")
def valkey() -> Any:
    server = ValkeyProcess()
    yield server
    server.stop()


def prompts(seed: int = 0, n: int = 3, shared: int = 96, own: int = 24) -> list[list[int]]:
    """``n`` prompts sharing a ``shared``-token prefix (as a system prompt is)."""
    rng = random.Random(seed)
    system = [rng.randrange(5, 250) for _ in range(shared)]
    return [system + [rng.randrange(5, 250) for _ in range(own)] for _ in range(n)]


def run(engine: Engine, ps: list[list[int]], namespace: Any = None) -> list[list[int]]:
    outs = engine.generate(ps, GREEDY, use_tqdm=False, namespace=namespace)
    engine.check_invariants()
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def cold(tiny: LoadedModel) -> dict[int, list[list[int]]]:
    """Greedy outputs with no cache tier at all, per prompt seed."""
    eng = Engine(tiny, page_size=4, num_pages=256)
    return {seed: run(eng, prompts(seed)) for seed in (0, 1, 2)}


def storage_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "radixkv.storage"
        and r.levelno == logging.WARNING
        and "failed" in r.getMessage()
    ]


_PREVIOUS = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {root!r})
    sys.path.insert(0, {tests!r})
    from test_engine_storage import GREEDY, OPTS, prompts
    from radixkv.engine.engine import Engine
    with Engine("radixkv-tiny", kv_storage={url!r}, **OPTS) as eng:
        eng.generate(prompts(0), GREEDY, use_tqdm=False)
        eng.flush_storage()
        print(eng.stats().storage_write_pages)
    """
)


def test_restart_hits_the_previous_process_prefixes(
    tiny: LoadedModel, cold: dict[int, list[list[int]]], tmp_path: Path
) -> None:
    url = f"file://{tmp_path}/kv"
    code = _PREVIOUS.format(root=str(ROOT), tests=str(ROOT / "tests"), url=url)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(done.stdout.split()[-1]) > 0  # the previous process wrote pages
    events: list[Any] = []
    with Engine(tiny, kv_storage=url, **OPTS) as eng:
        eng.cache.add_listener(events.append)
        assert run(eng, prompts(0)) == cold[0]
        st = eng.stats()
    # the whole shared prefix (and more) came from storage; only the rest was computed
    assert st.prefix_cache_storage_hit_tokens >= 96
    assert st.storage_prefetch_pages * 4 >= 96
    assert (
        st.prefix_cache_device_hit_tokens
        + st.prefix_cache_host_hit_tokens
        + (st.prefix_cache_storage_hit_tokens)
        == st.prefix_cache_hit_tokens
    )
    assert st.storage_errors == 0 and st.storage_available == 1
    # KV events tell routers about pages loaded from storage: host first, then the device
    host_stored = [
        e for e in events if type(e).__name__ == "BlockStored" and e.medium == HOST_MEDIUM
    ]
    assert (
        host_stored and host_stored[0].token_ids == prompts(0)[0][: len(host_stored[0].token_ids)]
    )


@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_each_write_policy_reaches_storage(
    tiny: LoadedModel, cold: dict[int, list[list[int]]], tmp_path: Path, policy: str
) -> None:
    """write_through writes when a page is in the host tier, write_through_selective once hit
    (the prompts share a prefix: the second hits it), write_back when pages leave the host
    tier and at close. Each restart then hits, with the cold run's outputs."""
    url = f"file://{tmp_path}"
    with Engine(tiny, kv_storage=url, kv_storage_write_policy=policy, **OPTS) as eng:
        assert run(eng, prompts(1)) == cold[1]
    assert FileStorage(tmp_path).usage_bytes() > 0
    with Engine(tiny, kv_storage=url, **OPTS) as eng:
        assert run(eng, prompts(1)) == cold[1]
        assert eng.stats().prefix_cache_storage_hit_tokens >= 96


def test_fleet_second_engine_hits_the_first_engines_prefixes(
    tiny: LoadedModel, cold: dict[int, list[list[int]]], valkey: ValkeyProcess
) -> None:
    valkey.client.flushall()
    a = Engine(tiny, kv_storage=valkey.url, **OPTS)
    b = Engine(tiny, kv_storage=valkey.url, **OPTS)
    assert run(a, prompts(0)) == cold[0]
    assert a.flush_storage()
    assert run(b, prompts(0)) == cold[0]
    sa, sb = a.stats(), b.stats()
    assert sa.storage_write_pages > 0 and sa.prefix_cache_storage_hit_tokens == 0
    assert sb.prefix_cache_storage_hit_tokens >= 96
    # b computed only what storage did not have: at least the shared prefix less per replica
    assert sb.prefill_tokens_computed <= sa.prefill_tokens_computed - 96
    a.close()
    b.close()


def test_a_tenant_cannot_load_another_tenants_pages(
    tiny: LoadedModel, cold: dict[int, list[list[int]]], tmp_path: Path
) -> None:
    url = f"file://{tmp_path}"
    with Engine(tiny, kv_storage=url, **OPTS) as eng:
        run(eng, prompts(0), namespace="tenant-a")
    with Engine(tiny, kv_storage=url, **OPTS) as eng:
        assert run(eng, prompts(0), namespace="tenant-b") == cold[0]
        st = eng.stats()
        assert st.storage_prefetch_jobs > 0  # it looked, with identical tokens ...
        assert st.storage_prefetch_pages == 0 and st.prefix_cache_storage_hit_tokens == 0
        # ... while tenant A, same tokens, same store, hits (the control)
        assert run(eng, prompts(0), namespace="tenant-a") == cold[0]
        assert eng.stats().prefix_cache_storage_hit_tokens >= 96


def test_server_down_at_start_keeps_serving_with_one_warning(
    tiny: LoadedModel, cold: dict[int, list[list[int]]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="radixkv.storage")
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    with Engine(tiny, kv_storage=url, kv_storage_timeout=0.3, **OPTS) as eng:
        for _ in range(3):
            assert run(eng, prompts(0)) == cold[0]
        st = eng.stats()
    assert st.storage_errors >= 1 and st.storage_available == 0
    assert st.prefix_cache_device_hit_tokens > 0  # the device tier served repeats
    warnings = storage_warnings(caplog)
    assert len(warnings) == 1 and "unreachable" in warnings[0] and url in warnings[0]


def test_server_killed_mid_run_then_back(
    tiny: LoadedModel, cold: dict[int, list[list[int]]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="radixkv.storage")
    server = ValkeyProcess()
    try:
        eng = Engine(tiny, kv_storage=server.url, kv_storage_timeout=0.3, **OPTS)
        assert run(eng, prompts(0)) == cold[0]
        assert eng.flush_storage() and eng.stats().storage_write_pages > 0
        server.kill()  # the server crashes mid-run
        eng.reset_prefix_cache()  # the next prompts must go to storage for their prefix
        assert run(eng, prompts(0)) == cold[0]
        assert run(eng, prompts(1)) == cold[1]
        eng.flush_storage()
        st = eng.stats()
        assert st.storage_errors >= 1 and st.storage_available == 0
        assert len(storage_warnings(caplog)) == 1
        server = ValkeyProcess(port=server.port)  # restarted, empty
        eng.storage.io.retry_now()  # skip the rest of the back-off instead of sleeping
        assert run(eng, prompts(2)) == cold[2]  # new pages: a lookup and writes probe it
        assert eng.flush_storage()
        assert eng.stats().storage_available == 1
        assert any("available again" in r.getMessage() for r in caplog.records)
        assert server.client.dbsize() > 0  # writes go through again
        eng.close()
    finally:
        server.stop()


@pytest.mark.parametrize("fault", ["disk_full", "permission"])
def test_write_faults_warn_once_and_count(
    tiny: LoadedModel,
    cold: dict[int, list[list[int]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fault: str,
) -> None:
    caplog.set_level(logging.WARNING, logger="radixkv.storage")
    code = errno.ENOSPC if fault == "disk_full" else errno.EACCES
    real_open = os.open

    def failing_open(path: Any, *a: Any, **k: Any) -> int:
        if str(tmp_path) in str(path):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(os, "open", failing_open)
    with Engine(tiny, kv_storage=f"file://{tmp_path}", **OPTS) as eng:
        assert run(eng, prompts(0)) == cold[0]
        eng.flush_storage()
        assert run(eng, prompts(0)) == cold[0]  # the device and host tiers still serve
        st = eng.stats()
    assert st.storage_errors >= 1 and st.storage_dropped_write_pages > 0
    assert st.storage_write_pages == 0 and st.prefix_cache_device_hit_tokens > 0
    kind = "full" if fault == "disk_full" else "permission"
    warnings = storage_warnings(caplog)
    assert len(warnings) == 1 and f"({kind})" in warnings[0]


def test_a_corrupt_object_is_a_miss_deleted_with_a_warning(
    tiny: LoadedModel,
    cold: dict[int, list[list[int]]],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="radixkv.storage")
    url = f"file://{tmp_path}"
    with Engine(tiny, kv_storage=url, **OPTS) as eng:
        run(eng, prompts(0))
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    victim = files[len(files) // 2]
    victim.write_bytes(victim.read_bytes()[: HEADER_BYTES + 7])  # torn
    with Engine(tiny, kv_storage=url, **OPTS) as eng:
        assert run(eng, prompts(0)) == cold[0]
        st = eng.stats()
    # deleted when found, then written again whole by the run that recomputed it
    assert st.storage_corrupt_objects == 1 and victim.stat().st_size > HEADER_BYTES + 7
    assert any("corrupt" in r.getMessage() for r in caplog.records)


def test_slow_store_times_out_to_a_miss_and_full_queue_drops_writes(
    tiny: LoadedModel, cold: dict[int, list[list[int]]], tmp_path: Path
) -> None:
    url = f"file://{tmp_path}"
    with Engine(tiny, kv_storage=url, **OPTS) as eng:
        run(eng, prompts(0))
    gate = threading.Event()
    with Engine(
        tiny, kv_storage=url, kv_storage_timeout=0.2, kv_storage_write_queue=2, **OPTS
    ) as eng:
        reader = eng.storage.io._reader.backend
        writer = eng.storage.io._writer.backend
        real_get, real_put = reader.get_many, writer.put_many
        reader.get_many = lambda keys: (gate.wait(60), real_get(keys))[1]
        writer.put_many = lambda items: (gate.wait(60), real_put(items))[1]
        assert run(eng, prompts(0)) == cold[0]  # waited 0.2 s at most, then computed
        # the requests are done while the lookup is still stuck in the store
        assert any(not job.done for job in eng.storage.prefetches)
        st = eng.stats()
        assert st.prefix_cache_storage_hit_tokens == 0
        assert st.storage_dropped_write_pages > 0  # 2 pages of queue; the writer is stuck
        gate.set()
        assert eng.flush_storage(timeout=10)
        end = time.monotonic() + 10  # the reader reports the lookups it gave up on
        while eng.stats().storage_prefetch_timeouts < 1 and time.monotonic() < end:
            time.sleep(0.01)
        assert eng.stats().storage_prefetch_timeouts >= 1


def test_prefetch_threshold_skips_small_lookups(tiny: LoadedModel, tmp_path: Path) -> None:
    with Engine(
        tiny, kv_storage=f"file://{tmp_path}", kv_storage_prefetch_threshold=64, **OPTS
    ) as eng:
        run(eng, [list(range(10, 60))])  # 49 tokens could be found: below 64, no lookup
        assert eng.stats().storage_prefetch_jobs == 0
        run(eng, [list(range(100, 200))])
        assert eng.stats().storage_prefetch_jobs == 1


def test_config_cli_and_metrics(tiny: LoadedModel, tmp_path: Path) -> None:
    import argparse

    p = EngineConfig.add_cli_arguments(argparse.ArgumentParser())
    args = p.parse_args(
        ["--kv-storage", "redis://127.0.0.1:6379/0", "--kv-storage-write-policy", "write_back"]
    )
    cfg = EngineConfig.from_cli_args(args)
    assert cfg.kv_storage == "redis://127.0.0.1:6379/0"
    assert cfg.kv_storage_write_policy == "write_back"
    with pytest.raises(ValueError, match="kv_storage"):
        Engine(tiny, kv_storage="s3://bucket", page_size=4, num_pages=64)
    with pytest.raises(ValueError, match="prefix cache"):
        Engine(tiny, kv_storage=f"file://{tmp_path}", enable_prefix_cache=False, num_pages=64)
    with pytest.raises(ValueError, match="kv_storage_timeout"):
        EngineConfig(kv_storage_timeout=0)
    with pytest.raises(ValueError, match="kv_storage_write_policy"):
        EngineConfig(kv_storage_write_policy="sometimes")
    # storage without host_cache_memory gets a host tier of its own
    with Engine(tiny, kv_storage=f"file://{tmp_path}", page_size=4, num_pages=64) as eng:
        assert eng.host_kv_pool is not None and eng.host_kv_pool.num_pages == 64
        run(eng, prompts(0))
        text = ServerMetrics(eng.stats).render().decode()
    for name in (
        "radixkv_prefix_cache_storage_hits_tokens_total",
        "radixkv_storage_prefetch_pages_total",
        "radixkv_storage_write_pages_total",
        "radixkv_storage_dropped_write_pages_total",
        "radixkv_storage_errors_total",
        'radixkv_storage_available{model_name="radixkv"} 1.0',
    ):
        assert name in text, name


def test_an_adapters_pages_are_stored_for_that_adapter_only(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """An adapter's requests store their pages under its content digest: a new engine that loads
    the same files (under another name, even) hits them; the base model, with the same tokens
    and the same store, does not (its KV differs)."""
    from radixkv.model.lora import save_random_adapter

    url = f"file://{tmp_path}/kv"
    folder = save_random_adapter(tiny.config, tmp_path / "ad", seed=3)
    ps = prompts(4)
    with Engine(tiny, kv_storage=url, lora_modules={"ad": str(folder)}, **OPTS) as eng:
        outs = [o.token_ids for o in eng.generate(ps, GREEDY, use_tqdm=False, lora="ad")]
    with Engine(tiny, kv_storage=url, **OPTS) as eng:
        run(eng, ps)
        assert eng.stats().prefix_cache_storage_hit_tokens == 0
        eng.load_lora("same-files", folder)
        again = eng.generate(ps, GREEDY, use_tqdm=False, lora="same-files")
        assert [o.token_ids for o in again] == outs
        assert eng.stats().prefix_cache_storage_hit_tokens >= 96
        eng.check_invariants()


def test_storage_write_threshold_is_its_own(tiny: LoadedModel, tmp_path: Path) -> None:
    """kv_storage_write_threshold counts for storage alone (default: write_through_threshold,
    as when one knob drove both tiers); a value the cache cannot report is refused."""
    import argparse

    p = EngineConfig.add_cli_arguments(argparse.ArgumentParser())
    assert EngineConfig.from_cli_args(p.parse_args([])).kv_storage_write_threshold is None
    args = p.parse_args(["--kv-storage-write-threshold", "3"])
    assert EngineConfig.from_cli_args(args).kv_storage_write_threshold == 3
    with pytest.raises(ValueError, match="kv_storage_write_threshold must be an int >= 1"):
        EngineConfig(kv_storage_write_threshold=0)
    both = dict(
        write_policy="write_through_selective", kv_storage_write_policy="write_through_selective"
    )
    with pytest.raises(ValueError, match="kv_storage_write_threshold 3 exceeds write_through"):
        EngineConfig(write_through_threshold=2, kv_storage_write_threshold=3, **both)
    EngineConfig(write_through_threshold=3, kv_storage_write_threshold=2, **both)
    url = f"file://{tmp_path}"
    with Engine(tiny, kv_storage=url, write_through_threshold=3, **OPTS) as eng:
        assert eng.storage is not None and eng.storage.write_threshold == 3  # the default
    opts = dict(OPTS, kv_storage_write_policy="write_through_selective")
    with Engine(tiny, kv_storage=url, kv_storage_write_threshold=2, **opts) as eng:
        assert eng.storage is not None and eng.storage.write_threshold == 2
        prompt = prompts(3, n=1)
        for runs in range(1, 4):
            run(eng, prompt)
            assert eng.flush_storage()
            written = eng.stats().storage_write_pages
            # the host tier backs the prompt up at once (write_through), storage waits for
            # the second match through it (the second and third runs)
            assert (written > 0) == (runs == 3), (runs, written)
