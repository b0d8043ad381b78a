"""The gateway's drain at shutdown, on a cluster that holds its streams until told: new requests
are refused with 503 and Retry-After on both front doors and health says so, requests in flight
run on to their end, and those still running when the drain ends are cut off with an error that
says why (a stream's last event, a whole response, a gRPC status)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from engine.messages import TokenEvent
from engine.sampling import SamplingParams
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.gateway.auth import ApiKeys
from router.gateway.limits import RequestLimits
from router.gateway.served_model import ServedModel
from router.gateway.server import DrainOutcome, GatewayServer
from router.gateway.service import Gateway
from router.latency_forecast import AllowedWorkers
from tests.gateway.one_live_worker import OneLiveWorker

pytestmark = pytest.mark.timeout(120)

DEMO_MODEL = Path(__file__).resolve().parents[2] / "engine" / "demo_model" / "assets"
TOKEN = 264  # " the"
WAIT_S = 30.0  # for a condition on a busy machine


class HeldCluster(OneLiveWorker):
    """Sends each request's first token at once, the rest (up to max_tokens) once ``release``
    is set; until then the request stays in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        allowed: AllowedWorkers | None = None,
    ) -> AsyncGenerator[TokenEvent, None]:
        num_tokens = params.max_tokens or 4
        for position in range(num_tokens):
            if position == 1:
                while not self.release.is_set():
                    await asyncio.sleep(0.01)
            finish = "length" if position == num_tokens - 1 else None
            for sample in range(params.n):
                yield TokenEvent(request_id or "", sample, position, TOKEN, None, finish)


@pytest.fixture(scope="module")
def served_demo() -> ServedModel:
    return ServedModel.load(str(DEMO_MODEL), "pdserve-demo", None)


@contextlib.contextmanager
def _serving(cluster: HeldCluster, model: ServedModel) -> Iterator[GatewayServer]:
    gateway = Gateway(cluster, model, RequestLimits(max_model_len=model.max_model_len), ApiKeys([]))
    server = GatewayServer(gateway, "127.0.0.1", 0, 0)
    server.start()
    try:
        yield server
    finally:
        cluster.release.set()  # frees any request the test left held
        server.stop()


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _stream_lines(url: str, body: dict[str, Any], first_line: threading.Event) -> list[str]:
    """The non-empty lines of a streamed completion; ``first_line`` is set on its first."""
    lines = []
    with (
        httpx.Client(timeout=WAIT_S) as client,
        client.stream("POST", url, json={**body, "stream": True}) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if line:
                lines.append(line)
                first_line.set()
    return lines


def _events(lines: list[str]) -> list[Any]:
    """A stream's events, parsed, and "[DONE]"."""
    return [
        line.removeprefix("data: ") if line == "data: [DONE]" else json.loads(line[6:])
        for line in lines
    ]


def _grpc_generate(target: str, max_tokens: int) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(text="hi", max_tokens=max_tokens)
    with grpc.insecure_channel(target) as channel:
        return list(pb_grpc.GenerationStub(channel).Generate(request, timeout=WAIT_S))


def _drain_in_background(
    pool: concurrent.futures.ThreadPoolExecutor,
    server: GatewayServer,
    timeout_s: float,
    stop_now: threading.Event | None = None,
) -> concurrent.futures.Future[DrainOutcome]:
    drained = pool.submit(server.drain, timeout_s, stop_now or threading.Event())
    _wait_for(lambda: server.gateway.draining, "the drain to start")
    return drained


def test_a_draining_server_refuses_new_requests_and_lets_those_in_flight_finish(
    served_demo: ServedModel,
) -> None:
    cluster = HeldCluster()
    body = {"prompt": "hi", "max_tokens": 4}
    with (
        concurrent.futures.ThreadPoolExecutor(2) as pool,  # joined after the server stops
        _serving(cluster, served_demo) as server,
        httpx.Client(timeout=WAIT_S) as client,
    ):
        url = server.http_url + "/v1/completions"
        first_line = threading.Event()
        stream = pool.submit(_stream_lines, url, body, first_line)
        _wait_for(first_line.is_set, "the stream's first event")
        drained = _drain_in_background(pool, server, timeout_s=WAIT_S)

        for refused in (
            client.post(url, json=body),
            client.post(url, json={**body, "stream": True}),
        ):
            assert refused.status_code == 503, refused.text
            assert refused.headers["Retry-After"] == "5"
            assert refused.headers["retry-after-ms"] == "5000"  # the OpenAI SDK reads it first
            error = refused.json()["error"]
            assert (error["type"], error["code"]) == ("service_unavailable", "shutting_down")
            assert "shutting down" in error["message"]
        health = client.get(server.http_url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "shutting_down"
        with grpc.insecure_channel(server.grpc_target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            assert not stub.Health(pb.HealthRequest(), timeout=WAIT_S).serving
            with pytest.raises(grpc.RpcError) as call:
                list(stub.Generate(pb.GenerateRequest(text="hi", max_tokens=2), timeout=WAIT_S))
        assert call.value.code() == grpc.StatusCode.UNAVAILABLE
        assert ("retry-after", "5") in (call.value.trailing_metadata() or ())
        assert not drained.done()  # the stream in flight holds the drain

        cluster.release.set()
        events = _events(stream.result(timeout=WAIT_S))
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert not any("error" in event for event in events[:-1])
        assert drained.result(timeout=WAIT_S) == DrainOutcome(1, 0, cut_short=False)


def test_requests_still_running_when_the_drain_times_out_end_with_an_error(
    served_demo: ServedModel,
) -> None:
    cluster = HeldCluster()  # never released: every request is still running at the deadline
    body = {"prompt": "hi", "max_tokens": 4}
    with (
        concurrent.futures.ThreadPoolExecutor(4) as pool,
        _serving(cluster, served_demo) as server,
    ):
        url = server.http_url + "/v1/completions"
        first_line = threading.Event()
        stream = pool.submit(_stream_lines, url, body, first_line)
        whole = pool.submit(httpx.post, url, json=body, timeout=WAIT_S)
        calls = pool.submit(_grpc_generate, server.grpc_target, 4)
        _wait_for(lambda: server.gateway.num_in_flight == 3, "three requests in flight")

        outcome = server.drain(0.2, threading.Event())

        assert outcome == DrainOutcome(3, 3, cut_short=False)
        events = _events(stream.result(timeout=WAIT_S))
        assert events[-1] == "[DONE]"
        assert events[-3]["choices"][0]["finish_reason"] == "abort"
        error = events[-2]["error"]
        assert (error["type"], error["code"]) == ("service_unavailable", "shutting_down")
        assert "drain timeout of 0.2 s ran out" in error["message"]
        response = whole.result(timeout=WAIT_S)
        assert response.status_code == 503 and response.headers["Retry-After"] == "5"
        assert "drain timeout of 0.2 s ran out" in response.json()["error"]["message"]
        with pytest.raises(grpc.RpcError) as call:
            calls.result(timeout=WAIT_S)
        assert call.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "drain timeout of 0.2 s ran out" in (call.value.details() or "")
        assert server.gateway.num_in_flight == 0


def test_a_second_stop_signal_ends_the_drain_at_once(served_demo: ServedModel) -> None:
    cluster = HeldCluster()
    body = {"prompt": "hi", "max_tokens": 4}
    with (
        concurrent.futures.ThreadPoolExecutor(2) as pool,
        _serving(cluster, served_demo) as server,
    ):
        whole = pool.submit(httpx.post, server.http_url + "/v1/completions", json=body, timeout=60)
        _wait_for(lambda: server.gateway.num_in_flight == 1, "the request in flight")
        stop_now = threading.Event()
        drained = _drain_in_background(pool, server, timeout_s=600, stop_now=stop_now)

        stop_now.set()

        assert drained.result(timeout=WAIT_S) == DrainOutcome(1, 1, cut_short=True)
        response = whole.result(timeout=WAIT_S)
        assert response.status_code == 503
        assert "told to stop at once" in response.json()["error"]["message"]


def test_an_idle_server_drains_at_once(served_demo: ServedModel) -> None:
    with _serving(HeldCluster(), served_demo) as server:
        started = time.monotonic()
        assert server.drain(600, threading.Event()) == DrainOutcome(0, 0, cut_short=False)
        assert time.monotonic() - started < WAIT_S
