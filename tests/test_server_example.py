"""examples/custom_server.py: a user's own app embedding AsyncEngine, run live on loopback."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import httpx

from radixkv.server.background import BackgroundServer

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_server.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("custom_server_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_custom_server_example() -> None:
    app = _load().create_app(num_pages=512)
    prompt = "A shared system prompt that several requests reuse. " * 6
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        first = http.post(
            "/generate", json={"prompt": prompt, "max_tokens": 4, "user": "ann"}
        ).json()
        second = http.post(
            "/generate", json={"prompt": prompt + "More.", "max_tokens": 4, "user": "ann"}
        ).json()
        other = http.post(
            "/generate", json={"prompt": prompt, "max_tokens": 4, "user": "ben"}
        ).json()
        assert first["num_cached_tokens"] == 0 and first["finish_reason"] == "length"
        assert second["num_cached_tokens"] >= 256
        assert other["num_cached_tokens"] == 0  # another user's namespace
        again = http.post(
            "/generate", json={"prompt": prompt, "max_tokens": 4, "user": "ann"}
        ).json()
        assert again["text"] == first["text"]  # greedy, cache hit or miss

        with http.stream("POST", "/generate_stream", json={"prompt": prompt, "max_tokens": 6}) as r:
            assert r.status_code == 200
            events = [json.loads(line) for line in r.iter_lines() if line]
        assert events[-1]["finished"] and not any(e["finished"] for e in events[:-1])
        assert (
            "".join(e["delta"] for e in events)
            == http.post("/generate", json={"prompt": prompt, "max_tokens": 6}).json()["text"]
        )

        assert http.post("/generate", json={"prompt": "", "max_tokens": 4}).status_code == 400
        assert http.post("/generate_stream", json={"prompt": "x" * 17000}).status_code == 400
        assert http.post("/generate", json={"prompt": "x", "max_tokens": 0}).status_code == 422
        assert (
            http.post("/generate", json={"prompt": "still serving", "max_tokens": 2}).status_code
            == 200
        )
