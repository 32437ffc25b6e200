"""``pyxllm bench``: the metric math and the report on synthetic timings, then short real runs
of ``bench serve`` (against a live ``pyxllm serve``), ``bench throughput`` and ``bench latency``.
No timed assertion: only counts, fields and files are checked."""

from __future__ import annotations

import importlib
import json
import math

import pytest

from pyxllm.benchmarks.metrics import RequestRecord, compute_metrics, percentile, summarize
from pyxllm.benchmarks.prompts import make_prompts
from pyxllm.benchmarks.report import format_table, plot_png, write_json
from pyxllm.cli.main import main
from tests.paths import REPO_ROOT
from tests.utils import RemoteServer

ENGINE = ["--max-model-len", "128", "--kv-cache-memory", "0.05"]


def _record(start, chunks, end, tokens, prompt=10, success=True):
    return RequestRecord(
        prompt_tokens=prompt,
        output_tokens=tokens,
        start=start,
        chunk_times=chunks,
        end=end,
        success=success,
    )


def test_percentile_interpolates_like_numpy():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([0, 10], 99) == pytest.approx(9.9)
    assert percentile([5], 99) == 5
    assert math.isnan(percentile([], 50))
    assert summarize([0.001, 0.003]) == {"mean": 2.0, "median": 2.0, "p99": pytest.approx(2.98)}


def test_request_metrics_follow_vllm_definitions():
    r = _record(start=10.0, chunks=[10.5, 10.6, 10.8, 11.1], end=11.2, tokens=4)
    assert r.ttft == pytest.approx(0.5)
    assert r.latency == pytest.approx(1.2)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    assert r.tpot == pytest.approx((1.2 - 0.5) / 3)
    assert _record(0.0, [0.2], 0.3, tokens=1).tpot is None


def test_compute_metrics_aggregates_successes_and_counts_failures():
    records = [
        _record(0.0, [0.1, 0.2, 0.3], 0.3, tokens=3),
        _record(0.0, [0.3, 0.5, 0.7], 0.7, tokens=3, prompt=20),
        RequestRecord(prompt_tokens=10, start=0.0, end=0.1, error="HTTP 500"),
    ]
    m = compute_metrics(records, duration_s=2.0)
    assert (m.completed, m.failed) == (2, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (30, 6)
    assert (
        m.request_throughput == 1.0
        and m.output_throughput == 3.0
        and m.total_token_throughput == 18.0
    )
    assert m.ttft_ms["mean"] == pytest.approx(200.0) and m.ttft_ms["median"] == pytest.approx(200.0)
    assert m.e2el_ms["mean"] == pytest.approx(500.0)
    assert m.tpot_ms["mean"] == pytest.approx((100.0 + 200.0) / 2)
    assert m.itl_ms["median"] == pytest.approx(150.0)  # gaps 100, 100, 200, 200
    with pytest.raises(ValueError, match="duration"):
        compute_metrics(records, 0.0)


def test_report_table_json_and_plot(tmp_path):
    records = [
        _record(0.0, [0.1 * (i + 1), 0.1 * (i + 2)], 0.1 * (i + 2), tokens=2) for i in range(5)
    ]
    records.append(RequestRecord(error="boom"))
    metrics = compute_metrics(records, 1.0)
    table = format_table(metrics, "synthetic")
    for label in (
        "Successful requests",
        "Failed requests",
        "Output token throughput (tok/s)",
        "Median TTFT (ms)",
        "P99 TPOT (ms)",
        "Mean ITL (ms)",
        "Median E2EL (ms)",
    ):
        assert label in table
    payload = json.loads(
        write_json(tmp_path / "r.json", {"x": math.nan, **metrics.to_dict()}).read_text()
    )
    assert payload["x"] is None and payload["completed"] == 5 and payload["failed"] == 1
    pytest.importorskip("matplotlib")
    png = plot_png(tmp_path / "r.png", metrics, records, "synthetic")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prompts_have_the_asked_length(hf_gguf_tokenizer):
    for dataset in ("random", "fixed"):
        prompts = make_prompts(hf_gguf_tokenizer, 4, 50, dataset, seed=1)
        assert len(prompts) == 4
        assert all(45 <= len(ids) <= 50 for _, ids in prompts), [len(ids) for _, ids in prompts]
        assert (
            len(
                {ids[0] for _, ids in prompts}
                if dataset == "random"
                else {text[:12] for text, _ in prompts}
            )
            > 1
        )
    assert make_prompts(hf_gguf_tokenizer, 2, 20, "random", 7) == make_prompts(
        hf_gguf_tokenizer, 2, 20, "random", 7
    )
    with pytest.raises(ValueError, match="--dataset"):
        make_prompts(hf_gguf_tokenizer, 1, 5, "sharegpt")


def test_bench_serve_against_a_live_server(tmp_path, capsys):
    with RemoteServer(
        [*ENGINE, "--served-model-name", "bench-test"], env={"OMP_NUM_THREADS": "1"}
    ) as server:
        status = main(
            [
                "bench",
                "serve",
                "--base-url",
                server.base_url,
                "--num-prompts",
                "4",
                "--input-len",
                "16",
                "--output-len",
                "8",
                "--max-concurrency",
                "2",
                "--result-file",
                str(tmp_path / "serve.json"),
            ]
        )
    assert status == 0
    result = json.loads((tmp_path / "serve.json").read_text())
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["total_output_tokens"] == 32  # ignore_eos: exactly --output-len each
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(result[key]) == {"mean", "median", "p99"} and result[key]["median"] > 0
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
    assert "Median TTFT (ms)" in capsys.readouterr().out
    if (tmp_path / "serve.png").exists():
        assert (tmp_path / "serve.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_throughput_and_latency_run(tmp_path, capsys):
    assert (
        main(
            [
                "bench",
                "throughput",
                "--num-prompts",
                "3",
                "--input-len",
                "12",
                "--output-len",
                "4",
                *ENGINE,
                "--result-file",
                str(tmp_path / "t.json"),
            ]
        )
        == 0
    )
    t = json.loads((tmp_path / "t.json").read_text())
    assert t["num_prompts"] == 3 and t["total_output_tokens"] == 12 and t["output_tokens_per_s"] > 0
    assert (
        main(
            [
                "bench",
                "latency",
                "--input-len",
                "12",
                "--output-len",
                "4",
                "--num-iters",
                "1",
                "--num-iters-warmup",
                "0",
                "--quantization",
                "int4",
                "--enable-prefix-cache",
                "false",
                *ENGINE,
                "--result-file",
                str(tmp_path / "l.json"),
            ]
        )
        == 0
    )
    lat = json.loads((tmp_path / "l.json").read_text())
    assert (
        lat["quantization"] == "int4" and lat["ttft_ms_mean"] > 0 and lat["decode_tokens_per_s"] > 0
    )
    assert lat["enable_prefix_cache"] is False and lat["prefix_cache_hit_tokens"] == 0
    out = capsys.readouterr().out
    assert "Throughput:" in out and "Latency (batch 1" in out and "prefix cache off" in out


def test_bench_latency_prefills_a_fresh_prompt_per_request(tmp_path, capsys, monkeypatch):
    """With the prefix cache on, every request of ``bench latency`` (warm-up included) gets a
    prompt of its own: the engine's prefix-cache hit counter does not move during the timed
    requests, though it counts their lookups; sending a timed prompt again is a hit, so the
    check can fail."""
    from pyxllm.benchmarks import latency

    timed_request, seen = latency._timed_request, []

    def spy(engine, token_ids, max_tokens, request_id):
        before = engine.stats()
        result = timed_request(engine, token_ids, max_tokens, request_id)
        seen.append((engine, request_id, list(token_ids), before, engine.stats()))
        return result

    monkeypatch.setattr(latency, "_timed_request", spy)
    args = ["bench", "latency", "--input-len", "40", "--output-len", "2", "--num-iters", "2"]
    assert main([*args, *ENGINE, "--result-file", str(tmp_path / "l.json")]) == 0
    assert [s[1] for s in seen] == ["warmup-0", "latency-0", "latency-1"]
    engine, block = seen[0][0], seen[0][0].kv_cache_manager.block_size
    prompts = [s[2] for s in seen]
    assert all(len(p) >= 2 * block for p in prompts), [len(p) for p in prompts]
    for _, _, ids, before, after in seen[1:]:
        assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == len(ids)
        assert after["prefix_cache_hits"] == before["prefix_cache_hits"]
    lat = json.loads((tmp_path / "l.json").read_text())
    assert lat["enable_prefix_cache"] is True and lat["prefix_cache_hit_tokens"] == 0
    assert lat["num_iters"] == 2 and lat["prefill_tokens_per_s"] > 0
    assert "prefix cache on, 0 prompt tokens" in capsys.readouterr().out
    hits = engine.stats()["prefix_cache_hits"]
    timed_request(engine, prompts[-1], 2, "again")
    assert engine.stats()["prefix_cache_hits"] - hits >= 2 * block


@pytest.mark.parametrize("script", sorted(p.stem for p in (REPO_ROOT / "benchmarks").glob("*.py")))
def test_every_benchmark_script_imports(script, monkeypatch):
    """The scripts under benchmarks/ import each other's helpers (``from compare import ...``):
    a renamed helper breaks them only when they run, so each is imported here (their work is
    under ``main()``, which importing does not run)."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "benchmarks"))
    importlib.import_module(script)
