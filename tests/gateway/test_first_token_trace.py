"""The gateway records each prompt's first-token trace: every hop from the request's arrival
to its first chunk written, in path order, in ``pdserve:first_token_hop_seconds{hop}`` and, with
``--first-token-trace PATH``, as one JSON line per prompt.

The cluster is the real router over workers whose engine loops run in this process
(``tests/router/loop_actors``: one prefill and one decode worker, no Ray); the prefill worker
hands nothing off, so requests ask for one token, which it samples and finishes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.messages.first_token import HOPS, SIDE_STAMPS, STAMPS, FirstTokenTrace
from router.cli import build_parser
from router.gateway.first_token_log import FirstTokenLog
from router.gateway.served_model import ServedModel
from router.latency_forecast import Forecast
from router.serve_command import first_token_log
from tests.gateway.token_script import http_client
from tests.router.fake_actors import use_fake_ray
from tests.router.loop_actors import loop_cluster

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("traces") / "first_token_trace.jsonl"


@pytest.fixture(scope="module")
def http(llama_dir: Path, trace_path: Path) -> Iterator[httpx.Client]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        use_fake_ray(monkeypatch)
        workers = loop_cluster(llama_dir, num_prefill=1)
        model = ServedModel.load(str(llama_dir), MODEL, None)
        log = FirstTokenLog(trace_path)
        try:
            with http_client(workers.cluster, model, first_token_log=log) as client:
                yield client
        finally:
            workers.stop()


def _complete(http: httpx.Client, *, stream: bool) -> str:
    """A one-token completion; its response id."""
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 1, "stream": stream}
    if not stream:
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return str(response.json()["id"])
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return str(json.loads(lines[0][6:])["id"])


def _trace_lines(path: Path) -> dict[str, dict[str, Any]]:
    """The trace file's lines by request id."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return {line["request_id"]: line for line in lines}


def test_a_streamed_prompts_trace_carries_every_hop_in_order(
    http: httpx.Client, trace_path: Path
) -> None:
    response_id = _complete(http, stream=True)
    line = _trace_lines(trace_path)[f"{response_id}-0"]  # the prompt's id: response id, index
    assert line["worker_id"] == "prefill-0"
    assert line["decode_worker_id"] == "decode-0"  # where the router placed the rest
    stamps = line["stamps"]
    assert list(stamps) == [*STAMPS, *SIDE_STAMPS]
    path = [stamps[name] for name in STAMPS]
    assert None not in path, stamps
    assert path == sorted(path), stamps
    assert list(line["hops"]) == list(HOPS)
    for index, hop in enumerate(HOPS):
        assert line["hops"][hop] == pytest.approx(path[index + 1] - path[index])
    assert stamps["queued"] <= stamps["scheduled"] <= stamps["step_ended"]
    assert stamps["submit_sent"] <= stamps["submit_returned"]


def test_a_whole_responses_trace_ends_with_its_first_token_on_the_event_loop(
    http: httpx.Client, trace_path: Path
) -> None:
    response_id = _complete(http, stream=False)
    line = _trace_lines(trace_path)[f"{response_id}-0"]
    assert line["stamps"]["written"] is None  # no chunk: the whole response comes at the end
    assert list(line["hops"]) == list(HOPS[:-1])


def test_a_prompts_forecast_is_written_beside_its_trace(tmp_path: Path) -> None:
    """The latencies predicted at admission and the placement they were predicted on, next
    to where it ran: a forecast's error can be told from a placement elsewhere."""
    log = FirstTokenLog(tmp_path / "trace.jsonl")
    trace = FirstTokenTrace("prefill-1", 1.0, 1.0, 1.0, 1.0, 1.2, 1.2, decode_worker_id="decode-0")
    log.write("r-0", trace, Forecast(0.25, 0.05, "prefill-0", 0.01, "decode-1", 0.0))
    log.write("r-1", trace)
    log.close()
    lines = _trace_lines(tmp_path / "trace.jsonl")
    assert (lines["r-0"]["worker_id"], lines["r-0"]["decode_worker_id"]) == (
        "prefill-1",
        "decode-0",
    )
    assert lines["r-0"]["forecast"] == {
        "ttft_s": 0.25,
        "queue_s": 0.05,
        "prefill_worker_id": "prefill-0",
        "tpot_s": 0.01,
        "decode_worker_id": "decode-1",
    }
    assert "forecast" not in lines["r-1"]  # none was made


def test_metrics_show_each_hops_buckets_after_a_request(http: httpx.Client) -> None:
    _complete(http, stream=True)
    text = http.get("/metrics").text
    for hop in HOPS:
        counts = re.findall(
            rf'^pdserve:first_token_hop_seconds_count\{{hop="{hop}"\}} (\S+)$', text, re.M
        )
        assert counts and float(counts[0]) >= 1, hop
        buckets = re.findall(
            rf'^pdserve:first_token_hop_seconds_bucket\{{hop="{hop}",le="[^"]+"\}} ', text, re.M
        )
        assert len(buckets) > 10, hop


def test_the_serve_flag_names_the_trace_file(tmp_path: Path) -> None:
    serve = ["serve", "--first-token-trace", str(tmp_path / "t.jsonl")]
    assert build_parser().parse_args(serve).first_token_trace == str(tmp_path / "t.jsonl")
    assert build_parser().parse_args(["serve"]).first_token_trace is None  # off by default
    with pytest.raises(ValueError, match="--first-token-trace .*/missing/t.jsonl"):
        first_token_log(str(tmp_path / "missing" / "t.jsonl"))
