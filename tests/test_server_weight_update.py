"""SGLang's weight-update routes: POST /update_weights_from_disk (admin key) and GET
/get_weight_version, as RL frameworks drive a rollout server between training steps."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_helpers import save_tiny_folder
from server_helpers import checked_http, in_loop, live_server, metric_values

from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.server.background import BackgroundServer
from radixkv.server.config import ServerConfig
from radixkv.server.state import ServerState

ADMIN = "weights-admin-key-01"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
IDS = [(7 * i + 3) % 250 + 5 for i in range(50)]  # a prompt of a few pages
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[BackgroundServer, ServerState]]:
    with live_server(ServerConfig(admin_key=ADMIN), page_size=4) as s:
        yield s


@pytest.fixture
def http(server: tuple[BackgroundServer, ServerState]) -> Iterator[httpx.Client]:
    with checked_http(server) as c:
        yield c


def greedy_ids(name: str, ids: list[int], n: int) -> list[int]:
    eng = Engine(name, page_size=4, num_pages=256)
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return list(eng.generate([ids], sp, use_tqdm=False)[0].token_ids)


def generate(http: httpx.Client, **body: Any) -> Any:
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_update_from_disk_serves_the_new_weights(
    http: httpx.Client, server: tuple[BackgroundServer, ServerState], tmp_path: Path
) -> None:
    new = save_tiny_folder("radixkv-tiny-random", tmp_path / "step-1")
    old = save_tiny_folder("radixkv-tiny", tmp_path / "step-0")
    assert generate(http, input_ids=IDS, sampling_params=GREEDY)["output_ids"] == greedy_ids(
        "radixkv-tiny", IDS, 8
    )
    body = {"model_path": str(new), "weight_version": "step-1"}
    assert http.post("/update_weights_from_disk", json=body).status_code == 401  # admin only
    r = http.post("/update_weights_from_disk", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["success"] is True and answer["num_paused_requests"] == 0
    assert "step-1" in answer["message"]
    assert http.get("/get_weight_version").json() == {"weight_version": "step-1"}
    assert http.get("/get_model_info").json()["weight_version"] == "step-1"
    out = generate(http, input_ids=IDS, sampling_params=GREEDY)
    assert out["output_ids"] == greedy_ids("radixkv-tiny-random", IDS, 8)
    assert out["meta_info"]["weight_version"] == "step-1"
    assert out["meta_info"]["cached_tokens"] == 0  # the old weights' pages were dropped
    metrics = metric_values(http.get("/metrics").text)
    done = in_loop(server[1], server[1].engine.stats).weight_updates
    assert metrics["radixkv_weight_updates_total"] == done >= 1
    # back to the first checkpoint
    r = http.post("/update_weights_from_disk", json={"model_path": str(old)}, headers=AUTH)
    assert r.status_code == 200 and r.json()["success"]
    assert generate(http, input_ids=IDS, sampling_params=GREEDY)["output_ids"] == greedy_ids(
        "radixkv-tiny", IDS, 8
    )


def test_a_bad_update_is_a_400_and_changes_nothing(
    http: httpx.Client, server: tuple[BackgroundServer, ServerState], tmp_path: Path
) -> None:
    before = generate(http, input_ids=IDS, sampling_params=GREEDY)
    version = server[1].engine.engine.weight_version
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    for path in (tmp_path / "missing", broken):
        r = http.post("/update_weights_from_disk", json={"model_path": str(path)}, headers=AUTH)
        assert r.status_code == 400
        answer = r.json()
        assert answer["success"] is False and str(path.name) in answer["message"]
    r = http.post(
        "/update_weights_from_disk",
        json={"model_path": str(broken), "flush_cache": False},
        headers=AUTH,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "flush_cache"
    r = http.post("/update_weights_from_disk", json={"flush_cache": True}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model_path"
    after = generate(http, input_ids=IDS, sampling_params=GREEDY)
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["weight_version"] == version


def test_a_stream_in_flight_is_retracted_and_finishes(
    http: httpx.Client, server: tuple[BackgroundServer, ServerState], tmp_path: Path
) -> None:
    new = save_tiny_folder("radixkv-tiny-random", tmp_path / "w")
    chunks: list[Any] = []
    first = threading.Event()

    def consume() -> None:
        body = {
            "input_ids": IDS,
            "sampling_params": {**GREEDY, "max_new_tokens": 200},
            "stream": True,
        }
        with (
            httpx.Client(base_url=server[0].url, timeout=60) as c,
            c.stream("POST", "/generate", json=body) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    first.set()

    t = threading.Thread(target=consume)
    t.start()
    assert first.wait(30)
    body = {"model_path": str(new), "weight_version": "streamed"}
    r = http.post("/update_weights_from_disk", json=body, headers=AUTH)
    t.join(60)
    assert r.status_code == 200 and r.json()["num_paused_requests"] == 1
    last = chunks[-1]
    assert len(last["output_ids"]) == 200
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert last["meta_info"]["weight_version"] == "streamed"
    # the module's server back on the weights it started with (other tests expect them)
    old = save_tiny_folder("radixkv-tiny", tmp_path / "back")
    r = http.post("/update_weights_from_disk", json={"model_path": str(old)}, headers=AUTH)
    assert r.status_code == 200 and r.json()["success"]
