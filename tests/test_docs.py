"""The docs build strictly, the benchmark report renders, and every notebook executes.

The mkdocs build and the notebooks run in subprocesses: their own libraries' deprecation
warnings must not trip pytest's warnings-as-errors, and a notebook kernel needs its own process
anyway. Notebooks are executed on a copy; the committed files (with their outputs) are untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "docs" / "notebooks"
# Every notebook the docs link to; a missing or extra file fails test_notebook_list.
NOTEBOOKS: list[str] = [
    "01_radix_tree.ipynb",
    "02_branch_sharing.ipynb",
    "03_multi_turn_chat.ipynb",
    "04_embedding.ipynb",
]

sys.path.insert(0, str(ROOT / "bench"))
import make_report  # noqa: E402


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # the kernel spec may launch "python" from PATH: make it this interpreter
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("JUPYTER_PLATFORM_DIRS", "1")
    # one intra-op thread: radixkv-tiny's matmuls are tiny, and on a busy 2-core machine two
    # spinning OpenMP threads make a decode step ~100x slower than one thread does
    env["OMP_NUM_THREADS"] = "1"
    env["MPLBACKEND"] = "Agg"
    env["TQDM_DISABLE"] = "1"
    return env


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the API reference was generated from docstrings, not left as a bare ::: directive
    api = (site / "api" / "viz" / "index.html").read_text(encoding="utf-8")
    assert "draw_tree" in api and ":::" not in api
    assert (site / "concepts" / "index.html").exists()


def test_make_report_renders_results(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    rows = [
        {"policy": pol, "pool_vs_hot_set": f, "pool_pages": int(1000 * f), "hit_rate": h,
         "ideal_hit_rate": 0.8}
        for pol, f, h in [("lru", 0.1, 0.3), ("lru", 1.0, 0.8), ("lfu", 0.1, 0.5), ("lfu", 1.0, 0.8)]
    ]  # fmt: skip
    (results / "bench_tuning.json").write_text(
        json.dumps({"machine": "test box", "date": "2030-01-02", "pool_policy": rows})
    )
    (results / "zz_custom.json").write_text(json.dumps({"x": 1.5, "nested": {"a": {"b": 2}}}))
    out = tmp_path / "docs" / "benchmarks.md"
    text = make_report.build_report(results, out, tmp_path / "docs" / "img")
    assert out.read_text() == text
    assert "*Machine:* test box" in text and "*Date:* 2030-01-02" in text
    assert "| lfu | 0.1 | 100 | 0.5 | 0.8 |" in text
    assert "![" in text and (tmp_path / "docs" / "img" / "bench_tuning.png").stat().st_size > 1000
    # an unknown file is still rendered, after the known sections, with a fallback date
    assert text.index("## zz_custom") > text.index("## Tuning")
    assert "(file time)" in text
    assert "(committed)" not in text  # tmp_path is no git repository
    # a known file whose data does not fit its plot is rendered without a plot
    (results / "bench_cascade.json").write_text(json.dumps({"rows": [{"unexpected": 1}]}))
    text = make_report.build_report(results, out, tmp_path / "docs" / "img")
    assert "## Cascade attention" in text and "bench_cascade.png" not in text


def test_make_report_renders_bench_peers(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()

    def row(system: str, precision: str, s: float) -> dict:
        agree = {"identical": "32/32", "identical_frac": 1.0, "mean_agreeing_prefix": 32.0}
        return {"system": system, "precision": precision, "median_s": s, "runs_s": [s, s, s],
                "agreement_vs_transformers_float32": agree}  # fmt: skip

    rows = [row("radixkv float32", "float32", 2.0), row("llama.cpp f32", "float32", 5.0),
            row("transformers float32 batched", "float32", 9.0)]  # fmt: skip
    limit = {"all_cores": {"threads": 2, "bfloat16": {"peak_gflops": 950.0,
                                                       "prefill_share_of_peak": 0.66}}}  # fmt: skip
    data = {"machine": "box", "date": "2030-01-02", "shared_prefix": rows, "no_sharing": rows,
            "cpu_limit": limit}  # fmt: skip
    (results / "bench_peers.json").write_text(json.dumps(data))
    text = make_report.build_report(results, tmp_path / "benchmarks.md", tmp_path / "img")
    assert "## Against the peers: transformers and llama.cpp" in text
    assert "| llama.cpp f32 | float32 | 5 |" in text
    assert "| all_cores | 2 | 950 | 0.66 |" in text  # cpu_limit: one row per thread count
    assert (tmp_path / "img" / "bench_peers.png").stat().st_size > 1000


def test_notebook_list() -> None:
    found = sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb"))
    assert found == sorted(NOTEBOOKS)


_RUNNER = """
import sys, nbformat
from nbclient import NotebookClient
nb = nbformat.read(sys.argv[1], as_version=4)
NotebookClient(nb, kernel_name="python3", timeout=240,
               resources={"metadata": {"path": sys.argv[2]}}).execute()
errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
          if o.get("output_type") == "error"]
assert not errors, errors
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name: str) -> None:
    path = NOTEBOOK_DIR / name
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(path), str(ROOT)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    # committed notebooks carry their outputs, so the docs show results without running them
    nb = json.loads(path.read_text(encoding="utf-8"))
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(c.get("outputs") is not None for c in code)
    assert any(c.get("outputs") for c in code), f"{name} was committed without outputs"
    print(f"{name}: {time.monotonic() - t0:.1f}s")


def test_index_cache_snippet_runs() -> None:
    """The torch-free quick-start on the docs' front page is real code, not a sketch."""
    import re

    text = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    cache_blocks = [b for b in blocks if "RadixCache(" in b]
    assert cache_blocks, "the front page lost its cache example"
    for block in cache_blocks:
        exec(compile(block, "docs/index.md", "exec"), {})


def run_embedding_example(marker: str, what: str) -> dict[str, Any]:
    """Run the one python block of docs/embedding.md containing ``marker`` (the ``what``
    example); returns the names it defined."""
    import re

    text = (ROOT / "docs" / "embedding.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if marker in b]
    assert len(blocks) == 1, f"docs/embedding.md lost its {what} example"
    scope: dict[str, Any] = {}
    exec(compile(blocks[0], "docs/embedding.md", "exec"), scope)
    return scope


def test_embedding_sampling_snippet_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The sampling example of docs/embedding.md runs, and its logit bias holds."""
    out = run_embedding_example("logit_bias", "sampling")["out"]
    assert "#" not in out.text  # the logit bias
    assert capsys.readouterr().out


def test_embedding_label_scores_snippet_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The scoring example of docs/embedding.md runs: three items, each pair of label
    probabilities sums to 1, and the query came from the cache after the first item."""
    scope = run_embedding_example("eng.score(", "scoring")
    assert len(scope["scores"]) == 3
    assert all(abs(a + b - 1) < 1e-9 for a, b in scope["scores"])
    assert len(scope["first"]) in (2, 3)  # the sampled token, unless it is T or F itself
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5 and int(lines[-1].split()[0]) > 0


def test_embedding_structured_output_snippet_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The structured-output example of docs/embedding.md runs: each sample is JSON with the
    schema's required keys, and the label is one of the choices."""
    run_embedding_example("GuidedDecodingParams", "structured-output")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[-1] in ("spam", "ham")
    for line in lines[:3]:
        reason, value = line.split(" ", 1)
        if reason == "stop":
            assert "'name'" in value and "'year'" in value


def test_embedding_grammar_snippet_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The grammar example of docs/embedding.md runs: three samples, each a nested list (whole
    when it stopped, a prefix of one when cut)."""
    import re

    run_embedding_example('guided={"grammar"', "grammar")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    for line in lines:
        reason, text = line.split(" ", 1)
        flat, folded = "", text
        while folded != flat:  # innermost lists of words, folded to a word, until none is left
            flat, folded = folded, re.sub(r"\[(?:[a-z]{1,4}(?:,[a-z]{1,4})*)?\]", "w", folded)
        if reason == "stop":
            assert flat == "w", text
        else:
            assert reason == "length" and text.startswith("[")


def test_embedding_scoring_snippet_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The scoring example of docs/embedding.md runs: every answer token scored, nothing before
    the start, and the answers after the first served the context from the cache."""
    scope = run_embedding_example("prompt_logprobs_start", "scoring")
    n, outs = scope["ctx_len"], scope["outs"]
    for a, o in zip(scope["answers"], outs):
        assert o.prompt_logprobs[:n] == [None] * n
        assert all(e is not None for e in o.prompt_logprobs[n:])
        assert len(o.prompt_logprobs) == len(o.prompt_token_ids) == n + len(a.encode())  # bytes
    assert [o.num_cached_tokens > 0 for o in outs] == [False, True, True]
    assert len(capsys.readouterr().out.splitlines()) == len(outs)


def test_embedding_lora_snippet_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The LoRA example of docs/embedding.md runs: three continuations of one prompt in one
    batch, each with its adapter (the random adapters change the greedy text), and the unload
    leaves one adapter."""
    scope = run_embedding_example("save_random_adapter", "LoRA")
    outs = scope["outs"]
    assert [o.lora for o in outs] == [None, "sql", "docs"]
    assert len({o.text for o in outs}) == 3
    assert [i.name for i in scope["eng"].list_loras()] == ["sql"]
    assert len(capsys.readouterr().out.splitlines()) == 3


def test_embedding_weight_update_snippet_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The weight-update example of docs/embedding.md runs: the request in flight was
    retracted, finishes with all its tokens under the new version, and nothing leaks."""
    scope = run_embedding_example("update_weights(", "weight-update")
    update, eng = scope["update"], scope["eng"]
    assert update.retracted == 1 and update.dropped_pages >= 0 and not update.complete
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"1 {update.dropped_pages}"
    assert lines[-1].startswith("step-1 length ")
    eng.check_invariants()


def test_make_report_dates_a_committed_result_by_its_commit(tmp_path: Path) -> None:
    """A fresh checkout stamps every file with the checkout time: a result without a date of
    its own is dated by the commit of its content, and by its file time once changed."""
    if shutil.which("git") is None:
        pytest.skip("needs git")
    results = tmp_path / "results"
    results.mkdir()
    f = results / "zz_custom.json"
    f.write_text(json.dumps({"x": 1}))
    env = {**os.environ, "GIT_COMMITTER_DATE": "2031-02-03T04:05:00+00:00",
           "GIT_AUTHOR_DATE": "2031-02-03T04:05:00+00:00"}  # fmt: skip

    def git(*args: str) -> None:
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=tmp_path, env=env, check=True, capture_output=True,
        )  # fmt: skip

    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "results")
    out = tmp_path / "docs" / "benchmarks.md"
    text = make_report.build_report(results, out, tmp_path / "docs" / "img")
    assert "*Date:* 2031-02-03 04:05 UTC (committed)" in text
    f.write_text(json.dumps({"x": 2}))  # rerun, not committed yet
    text = make_report.build_report(results, out, tmp_path / "docs" / "img")
    assert "(committed)" not in text and "(file time)" in text


def test_embedding_beam_search_snippet_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The beam search example of docs/embedding.md runs: the 2 best of 4 beams, best first."""
    out = run_embedding_example("beam_width", "beam search")["out"]
    assert len(out.outputs) == 2 and out.outputs[0].score >= out.outputs[1].score
    assert out.outputs[0].text != out.outputs[1].text
    assert len(capsys.readouterr().out.splitlines()) == 2
