"""Streams against a cluster that paces or fails its tokens on cue: a stream holds its slot from
the moment it is accepted (so a refusal is still a status code, counted once) and gives it back
however it ends; a cluster failure, and logprobs' text offsets, read the same streamed or whole.

The cluster here is a scripted ``GenerationBackend`` (the gateway's one dependency), so the
failures happen exactly when the test says; the real tokenizer and gateway run around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import threading
import time
from collections.abc import AsyncGenerator, Iterator, Sequence
from pathlib import Path

import httpx
import pytest
from starlette.requests import Request
from starlette.types import Message

from engine.messages import TokenEvent
from engine.sampling import SamplingParams
from engine.sampling.messages import TokenLogprobs
from router.cluster import RequestFailedError
from router.gateway.auth import ApiKeys
from router.gateway.errors import ApiError
from router.gateway.http_app import _generate
from router.gateway.limits import RequestLimits
from router.gateway.served_model import ServedModel
from router.gateway.server import GatewayServer
from router.gateway.service import Gateway
from router.latency_forecast import AllowedWorkers
from tests.gateway.one_live_worker import OneLiveWorker

pytestmark = pytest.mark.timeout(120)

DEMO_MODEL = Path(__file__).resolve().parents[2] / "engine" / "demo_model" / "assets"
TOKENS = (318, 264, 1400, 286, 4444, 13)  # "ic", " the", " trace", "ct", "", "+"


class ScriptedCluster(OneLiveWorker):
    """Yields ``length`` positions of ``TOKENS`` (over again) one every ``pace_s``; fails at
    position ``fail_at``."""

    def __init__(self, pace_s: float, fail_at: int | None = None, length: int = len(TOKENS)):
        super().__init__()
        self.pace_s = pace_s
        self.fail_at = fail_at
        self.length = length

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
        num_tokens = min(params.max_tokens or self.length, self.length)
        for position in range(num_tokens):
            if position == self.fail_at:
                raise RequestFailedError("decode worker decode-0 died and no other can resume")
            finish = "length" if position == num_tokens - 1 else None
            token = TOKENS[position % len(TOKENS)]
            logprobs = None
            if params.logprobs is not None:
                logprobs = TokenLogprobs(token, -0.5 - position, 1, (token,), (-0.5 - position,))
            for sample in range(params.n):
                yield TokenEvent(request_id or "", sample, position, token, logprobs, finish)
            await asyncio.sleep(self.pace_s)


@pytest.fixture(scope="module")
def served_demo() -> ServedModel:
    return ServedModel.load(str(DEMO_MODEL), "pdserve-demo", None)


@contextlib.contextmanager
def _serve(
    cluster: ScriptedCluster, model: ServedModel, **limits: int
) -> Iterator[tuple[Gateway, str]]:
    """The gateway over ``cluster``, and its completions URL."""
    gateway = Gateway(
        cluster, model, RequestLimits(max_model_len=model.max_model_len, **limits), ApiKeys([])
    )
    server = GatewayServer(gateway, "127.0.0.1", 0, None)
    server.start()
    try:
        yield gateway, server.http_url + "/v1/completions"
    finally:
        server.stop()


def _wait_until_idle(gateway: Gateway, timeout_s: float = 60.0) -> None:
    started = time.monotonic()
    while gateway.num_in_flight and time.monotonic() - started < timeout_s:
        time.sleep(0.02)
    assert gateway.num_in_flight == 0


def _requests_by_status(gateway: Gateway) -> dict[str, float]:
    """``pdserve:requests_total`` by status, the statuses counted at least once."""
    counts: dict[str, float] = {}
    for metric in gateway.metrics.registry.collect():
        if metric.name == "pdserve:requests":
            for sample in metric.samples:
                if sample.name.endswith("_total") and sample.value:
                    counts[sample.labels["status"]] = sample.value
    return counts


def _post(body: dict[str, object]) -> Request:
    """A POST of ``body`` as the endpoint receives it."""
    payload = json.dumps(body).encode()

    async def receive() -> Message:
        return {"type": "http.request", "body": payload, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    return Request(scope, receive)


def test_a_stream_takes_its_slot_before_its_response_starts(served_demo: ServedModel) -> None:
    """One slot: a second stream accepted before the first has sent a byte is refused with a
    status code, 429 and Retry-After, counted once. (Before, the slot was taken only once the
    first stream's body began, so streams arriving together all got a 200, the late ones with an
    error event in it, each counted twice.) The slot comes back when the stream ends."""
    limits = RequestLimits(max_model_len=served_demo.max_model_len, max_concurrent_requests=1)
    gateway = Gateway(ScriptedCluster(pace_s=0.01), served_demo, limits, ApiKeys([]))
    body = {"prompt": "hi", "max_tokens": 3, "stream": True}
    sent: list[Message] = []

    async def scenario() -> None:
        first = await _generate(gateway, _post(body), "completion", time.monotonic())
        assert gateway.num_in_flight == 1
        with pytest.raises(ApiError) as refused:
            await _generate(gateway, _post(body), "completion", time.monotonic())
        assert (refused.value.status, refused.value.retry_after_s) == (429, 1)

        async def send(message: Message) -> None:
            sent.append(message)

        async def client_stays() -> Message:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        await first({"type": "http", "asgi": {"spec_version": "2.4"}}, client_stays, send)

    asyncio.run(scenario())
    assert sent[0]["status"] == 200
    assert sent[-2]["body"] == b"data: [DONE]\n\n"
    assert gateway.num_in_flight == 0
    assert _requests_by_status(gateway) == {"ok": 1.0, "rejected": 1.0}


def test_a_stream_the_client_leaves_gives_its_slot_back(served_demo: ServedModel) -> None:
    body = {"prompt": "hi", "max_tokens": 6, "stream": True}
    cluster = ScriptedCluster(pace_s=0.5)
    with (
        _serve(cluster, served_demo, max_concurrent_requests=1) as (gateway, url),
        httpx.Client(timeout=60) as client,
    ):
        with client.stream("POST", url, json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)
            assert gateway.num_in_flight == 1
        _wait_until_idle(gateway)  # the client left after one event
        assert client.post(url, json={**body, "max_tokens": 1}).status_code == 200


def test_a_cluster_failure_reads_the_same_streamed_or_whole(served_demo: ServedModel) -> None:
    body = {"prompt": "hi", "max_tokens": 6}
    with _serve(ScriptedCluster(pace_s=0.01, fail_at=2), served_demo) as (gateway, url):
        with httpx.Client(timeout=60) as client:
            whole = client.post(url, json=body)
            assert whole.status_code == 503 and whole.headers["Retry-After"] == "1"
            assert whole.json()["error"]["type"] == "service_unavailable"
            with client.stream("POST", url, json={**body, "stream": True}) as response:
                lines = [line for line in response.iter_lines() if line]
            assert response.status_code == 200  # sent with the first token, before the failure
            assert lines[-1] == "data: [DONE]"
            error = json.loads(lines[-2].removeprefix("data: "))["error"]
            assert error["type"] == "service_unavailable"
            assert "decode-0 died" in error["message"]
        assert _requests_by_status(gateway) == {"failed": 2.0}
        _wait_until_idle(gateway)


def test_a_cluster_failure_ends_a_responses_stream_with_an_error_event(
    served_demo: ServedModel,
) -> None:
    """/v1/responses: the whole response is the 503; the stream's last event is OpenAI's
    ``error`` event, numbered on from the others (no ``[DONE]``, as OpenAI's streams)."""
    body = {"input": "hi", "max_output_tokens": 6}
    with _serve(ScriptedCluster(pace_s=0.01, fail_at=2), served_demo) as (gateway, url):
        url = url.replace("/v1/completions", "/v1/responses")
        with httpx.Client(timeout=60) as client:
            assert client.post(url, json=body).status_code == 503
            with client.stream("POST", url, json={**body, "stream": True}) as response:
                lines = [line for line in response.iter_lines() if line]
        assert response.status_code == 200
        events = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
        assert [line.removeprefix("event: ") for line in lines[::2]] == [e["type"] for e in events]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[0]["type"] == "response.created" and events[-1]["type"] == "error"
        assert "decode-0 died" in events[-1]["message"]
        assert "response.completed" not in [e["type"] for e in events]
        _wait_until_idle(gateway)


def test_streamed_text_offsets_are_the_whole_responses(served_demo: ServedModel) -> None:
    """The stop string "e+" holds back the "e" that ends " the" and " trace" until the next
    token rules it out, so those chunks carry a token's logprobs but only part of its text: the
    offsets still follow the tokens' text (they once followed the text sent, and fell behind)."""
    body = {"prompt": "hi", "max_tokens": 6, "logprobs": 1, "stop": ["e+"]}
    with _serve(ScriptedCluster(pace_s=0.0), served_demo) as (_, url), httpx.Client() as client:
        whole = client.post(url, json=body).json()["choices"][0]
        assert whole["text"] == "ic the tracect+"
        streamed_offsets: list[int] = []
        with client.stream("POST", url, json={**body, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line.removeprefix("data: "))["choices"]:
                        streamed_offsets += choice["logprobs"]["text_offset"]
    assert whole["logprobs"]["text_offset"] == [0, 2, 6, 12, 14, 14]
    assert streamed_offsets == whole["logprobs"]["text_offset"]


def test_streams_flow_while_a_long_prompt_is_tokenized(served_demo: ServedModel) -> None:
    """A prompt at the character limit of a long-context model takes the tokenizer about a
    second. It is parsed on a thread of its own, so a stream already running keeps its pace
    meanwhile (the whole second, every stream stood still)."""
    text = "The quick brown fox jumps over the lazy dog, again and again. " * 8000
    while True:  # long enough to take the tokenizer half a second on this machine
        started = time.perf_counter()
        served_demo.tokenizer.encode(text)
        tokenize_s = time.perf_counter() - started
        if tokenize_s >= 0.5:
            break
        text *= 2
    model = dataclasses.replace(served_demo, max_model_len=len(text) // 16)  # within the limit
    cluster = ScriptedCluster(pace_s=0.01, length=2000)
    arrivals: list[float] = []
    with (
        _serve(cluster, model, max_body_bytes=len(text) + 4096) as (_, url),
        httpx.Client(timeout=60) as client,
    ):
        stream_body = {"prompt": "hi", "max_tokens": 2000, "stream": True}  # 20 s of tokens
        with client.stream("POST", url, json=stream_body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for _ in range(20):  # the stream is under way
                next(lines)
            outcome: list[int] = []
            long_prompt = threading.Thread(
                target=lambda: outcome.append(
                    client.post(url, json={"prompt": text, "max_tokens": 1}).status_code
                )
            )
            arrivals.append(time.perf_counter())
            long_prompt.start()
            while long_prompt.is_alive():
                next(lines)
                arrivals.append(time.perf_counter())
            next(lines)  # the gap that spans the end of the tokenizing, if any
            arrivals.append(time.perf_counter())
    assert outcome == [400]  # longer than the context: refused, once tokenized
    worst_gap = max(later - earlier for earlier, later in itertools.pairwise(arrivals))
    assert worst_gap < tokenize_s / 2, (worst_gap, tokenize_s)


class _CallEndedMidStream:
    """A gRPC call whose deadline passes during its stream and whose write under way fails on
    the ended call (as grpc's does, an ``ExecuteBatchError``) before the runtime cancels the
    handler: the race that failed a CI run of tests/gateway/test_grpc.py once."""

    def __init__(self, writes_before_the_end: int) -> None:
        self.writes: list[object] = []
        self.writes_before_the_end = writes_before_the_end

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def done(self) -> bool:
        return len(self.writes) >= self.writes_before_the_end

    async def write(self, message: object) -> None:
        if self.done():
            raise RuntimeError('Failed "execute_batch": (<SendMessageOperation>,)')
        self.writes.append(message)

    async def abort(self, code: object, details: str) -> None:
        raise AssertionError(f"aborted {code}: {details}")


@pytest.mark.parametrize("writes_before_the_end", [2, 3])  # mid-stream; at its usage
def test_a_grpc_call_that_ended_under_a_write_counts_as_aborted_not_failed(
    served_demo: ServedModel, caplog: pytest.LogCaptureFixture, writes_before_the_end: int
) -> None:
    from pdserve.v1 import generation_pb2 as pb
    from router.gateway.grpc_service import GenerationService

    limits = RequestLimits(max_model_len=served_demo.max_model_len)
    gateway = Gateway(ScriptedCluster(pace_s=0.01, length=2), served_demo, limits, ApiKeys([]))
    call = _CallEndedMidStream(writes_before_the_end)
    request = pb.GenerateRequest(text="hi", max_tokens=2)
    asyncio.run(GenerationService(gateway).Generate(request, call))  # type: ignore[arg-type]
    assert "Generate failed" not in caplog.text
    assert gateway.num_in_flight == 0
    # mid-stream: the client left; at its usage (its 2 tokens sent, started first): it finished
    expected = "aborted" if writes_before_the_end == 2 else "ok"
    assert _requests_by_status(gateway) == {expected: 1.0}
