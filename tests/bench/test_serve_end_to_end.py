"""``bench.serve`` against a running pdserve gateway on the tiny Llama: every request succeeds
with the asked-for output length, and the JSON and PNG files are written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.serving import (
    SLO,
    ArrivalSpec,
    BenchConfig,
    BenchmarkError,
    EndpointConfig,
    WorkloadSpec,
    run_benchmark,
    sweep,
)
from bench.serving.cli import main
from bench.serving.runner import load_codec
from bench.serving.workloads import build_requests
from router.gateway.server import GatewayServer
from tests.gateway.conftest import API_KEYS, MODEL_NAME

pytestmark = pytest.mark.timeout(240)


def _config(server: GatewayServer, tokenizer_dir: Path, **overrides: object) -> BenchConfig:
    settings: dict[str, object] = {
        "endpoint": EndpointConfig(server.http_url + "/v1", MODEL_NAME, API_KEYS[0]),
        "tokenizer_dir": str(tokenizer_dir),
        "workload": WorkloadSpec(kind="fixed", input_len=16, output_len=8),
        "arrivals": ArrivalSpec(math.inf, max_concurrency=4),
        "slo": SLO(ttft_ms=60_000, tpot_ms=60_000),
        "num_prompts": 8,
        "seed": 0,
        "progress": False,
    }
    settings.update(overrides)
    return BenchConfig(**settings)  # type: ignore[arg-type]


def test_cli_run_at_rate_inf_writes_json_and_plots(
    gateway_server: GatewayServer, chat_model_dir: Path, tmp_path: Path
) -> None:
    result_json, plot_dir = tmp_path / "result.json", tmp_path / "plots"
    argv = [
        f"--base-url={gateway_server.http_url}/v1",
        f"--model={MODEL_NAME}",
        f"--api-key={API_KEYS[0]}",
        f"--tokenizer={chat_model_dir}",
        "--workload=fixed",
        "--input-len=16",
        "--output-len=8",
        "--num-prompts=8",
        "--request-rate=inf",
        "--max-concurrency=4",
        f"--result-json={result_json}",
        f"--plot-dir={plot_dir}",
        "--no-progress",
    ]
    assert main(argv) == 0
    saved = json.loads(result_json.read_text())
    assert saved["config"]["arrivals"] == {
        "request_rate": "inf",
        "burstiness": 1.0,
        "max_concurrency": 4,
    }
    assert saved["config"]["endpoint"]["api_key"] == "<redacted>"
    assert API_KEYS[0] not in result_json.read_text()
    records = saved["records"]
    assert len(records) == 8 and all(r["success"] for r in records)
    assert [r["output_tokens"] for r in records] == [8] * 8
    assert all(r["output_tokens_source"] == "usage" for r in records)
    assert all(r["prompt_len"] == 16 for r in records)
    assert all(0 < r["ttft_s"] <= r["e2e_s"] for r in records)
    summary = saved["summary"]
    assert summary["num_completed"] == 8 and summary["total_output_tokens"] == 64
    assert summary["ttft"]["count"] == 8 and summary["ttft"]["percentiles_ms"]["p99"] > 0
    assert (plot_dir / "latency_cdf_rate-inf.png").stat().st_size > 0


def test_library_sweep_runs_each_rate_and_plots(
    gateway_server: GatewayServer, chat_model_dir: Path, tmp_path: Path
) -> None:
    from bench.serving.report import plot_sweep, sweep_dict, write_json

    config = _config(gateway_server, chat_model_dir, arrivals=ArrivalSpec(), num_prompts=4)
    result = sweep(config, [50.0, math.inf])
    assert [run.config.arrivals.request_rate for run in result.runs] == [50.0, math.inf]
    # each rate sends its own prompts: a prefix cache warmed by one rate cannot serve the next
    codec = load_codec(str(chat_model_dir))
    prompts = [
        [r.prompt for r in build_requests(config.workload, codec, 4, run.config.seed)]
        for run in result.runs
    ]
    assert not set(prompts[0]) & set(prompts[1])
    for run in result.runs:
        assert run.summary.num_completed == 4
        assert [r.output_tokens for r in run.records] == [8] * 4
    saved = json.loads(write_json(tmp_path / "sweep.json", sweep_dict(result)).read_text())
    assert saved["request_rates"] == [50.0, "inf"] and len(saved["runs"]) == 2
    assert plot_sweep(result, tmp_path / "sweep.png").stat().st_size > 0


def test_chat_endpoint_streams_too(gateway_server: GatewayServer, chat_model_dir: Path) -> None:
    endpoint = EndpointConfig(gateway_server.http_url + "/v1", MODEL_NAME, API_KEYS[1], "chat")
    result = run_benchmark(_config(gateway_server, chat_model_dir, endpoint=endpoint))
    assert result.summary.num_completed == 8
    assert all(r.output_tokens == 8 for r in result.records)


def test_a_failing_warm_up_stops_the_run(
    gateway_server: GatewayServer, chat_model_dir: Path
) -> None:
    endpoint = EndpointConfig(gateway_server.http_url + "/v1", MODEL_NAME, "sk-wrong-key")
    with pytest.raises(BenchmarkError, match="HTTP 401"):
        run_benchmark(_config(gateway_server, chat_model_dir, endpoint=endpoint))
