"""What the metrics say about a request, on a scripted cluster: latencies count from its arrival
at the front door, each prompt ends at its own last token, goodput is in requests as
``requests_total{status="ok"}`` is, and every ending is counted once under its own outcome
(aborted, failed, refused by the workers) with a stream that still ends the OpenAI way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from typing import ParamSpec, TypeVar

import grpc
import httpx
import pytest
from ray.exceptions import RayTaskError

from engine.messages import TokenEvent
from engine.sampling import SamplingParams
from pdserve.v1 import generation_pb2 as pb
from router.gateway.auth import ApiKeys
from router.gateway.limits import RequestLimits
from router.gateway.served_model import ServedModel
from router.gateway.service import Gateway
from router.latency_forecast import AllowedWorkers
from tests.gateway.test_streams_on_a_scripted_cluster import (
    DEMO_MODEL,
    ScriptedCluster,
    _requests_by_status,
    _wait_until_idle,
)
from tests.gateway.token_script import both_doors

pytestmark = pytest.mark.timeout(120)

P = ParamSpec("P")
T = TypeVar("T")
PARSE_S = 0.3  # how long _SlowParseGateway takes to parse a request


@pytest.fixture(scope="module")
def served_demo() -> ServedModel:
    return ServedModel.load(str(DEMO_MODEL), "pdserve-demo", None)


class _SlowParseGateway(Gateway):
    """Parsing takes ``PARSE_S``, as a long prompt's tokenizing or a busy parser thread does."""

    async def parse(
        self, body_bytes: int | None, parse: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        await asyncio.sleep(PARSE_S)
        return await super().parse(body_bytes, parse, *args, **kwargs)


class _ByPromptLength(ScriptedCluster):
    """As many tokens as the prompt has (at most ``length``); records the request ids."""

    def __init__(self, pace_s: float) -> None:
        super().__init__(pace_s)
        self.request_ids: list[str] = []

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        allowed: AllowedWorkers | None = None,
    ) -> AsyncGenerator[TokenEvent, None]:
        self.request_ids.append(request_id or "")
        max_tokens = min(params.max_tokens or self.length, len(prompt_token_ids))
        params = dataclasses.replace(params, max_tokens=max_tokens)
        return super().generate(prompt_token_ids, params, request_id=request_id)


class _Refusing(ScriptedCluster):
    """Refuses ``n`` above 4 as a decode worker with max_num_seqs 4 does: a ValueError raised in
    a Ray actor, which reaches the gateway wrapped in a Ray task error."""

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
        if params.n > 4:
            cause = ValueError(f"n ({params.n}) must be <= max_num_seqs (4)")
            traceback = f"Traceback (most recent call last):\n  ...\nValueError: {cause}"
            raise RayTaskError("WorkerActor.submit", traceback, cause).as_instanceof_cause()
        async for event in super().generate(prompt_token_ids, params, request_id=request_id):
            yield event


class _Broken(ScriptedCluster):
    """Fails at position 2 with an error the gateway does not expect."""

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
        async for event in super().generate(prompt_token_ids, params, request_id=request_id):
            if event.position == 2:
                raise KeyError("a bug")
            yield event


def _gateway(cluster: ScriptedCluster, model: ServedModel, keys: ApiKeys | None = None) -> Gateway:
    limits = RequestLimits(max_model_len=model.max_model_len, max_n=8)
    return Gateway(cluster, model, limits, keys or ApiKeys([]))


def _value(gateway: Gateway, name: str, **labels: str) -> float:
    return gateway.metrics.registry.get_sample_value(name, labels) or 0.0


def _events(lines: Iterator[str]) -> Iterator[str]:
    """The data of each server-sent event, as it comes."""
    return (line.removeprefix("data: ") for line in lines if line.startswith("data: "))


def test_latencies_count_from_the_arrival_before_the_parse(served_demo: ServedModel) -> None:
    """The parse (and the wait for a parser thread) is part of what a client waits for its first
    token: TTFT and e2e latency include it, over HTTP and gRPC. (They counted from the
    generation's start after it: a client waiting 0.8 s showed as 0.0004 s.)"""
    limits = RequestLimits(max_model_len=served_demo.max_model_len)
    gateway = _SlowParseGateway(ScriptedCluster(pace_s=0.0), served_demo, limits, ApiKeys([]))
    with both_doors(gateway, timeout_s=60) as (http, stub):
        body = {"prompt": "hi", "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 200
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            assert list(_events(response.iter_lines()))[-1] == "[DONE]"
        request = pb.GenerateRequest(text="hi", max_tokens=2)
        assert list(stub.Generate(request))[-1].WhichOneof("event") == "usage"
        _wait_until_idle(gateway)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert _value(gateway, f"pdserve:{name}_count") == 3
        assert _value(gateway, f"pdserve:{name}_bucket", le="0.25") == 0, name


def test_each_prompt_ends_at_its_own_last_token(served_demo: ServedModel) -> None:
    """Of one request's two prompts, the one that ends at its first token has the short e2e
    latency (both had the whole request's, 0.5 s)."""
    gateway = _gateway(_ByPromptLength(pace_s=0.1), served_demo)
    with both_doors(gateway, timeout_s=60) as (http, _):
        body = {"prompt": [[5], [5, 6, 7, 8, 9, 10]], "max_tokens": 6}
        response = http.post("/v1/completions", json=body)
        assert [c["finish_reason"] for c in response.json()["choices"]] == ["length"] * 2
    assert _value(gateway, "pdserve:e2e_request_latency_seconds_count") == 2
    assert _value(gateway, "pdserve:e2e_request_latency_seconds_bucket", le="0.25") == 1
    assert _value(gateway, "pdserve:e2e_request_latency_seconds_bucket", le="0.5") == 1


def test_goodput_is_in_requests_as_the_request_rate_is(served_demo: ServedModel) -> None:
    """A request of four prompts within both SLOs is one request of goodput (it was four, next
    to one ok request); its TTFT is still observed per prompt."""
    gateway = _gateway(ScriptedCluster(pace_s=0.0), served_demo)
    with both_doors(gateway, timeout_s=60) as (http, _):
        body = {"prompt": ["a", "b", "c", "d"], "max_tokens": 3}
        assert http.post("/v1/completions", json=body).status_code == 200
    assert _requests_by_status(gateway) == {"ok": 1.0}
    assert _value(gateway, "pdserve:slo_met_total") == 1
    assert _value(gateway, "pdserve:prompts_total") == 4
    assert _value(gateway, "pdserve:time_to_first_token_seconds_count") == 4


def test_an_http_request_aborted_through_grpc_ends_as_aborted(served_demo: ServedModel) -> None:
    """An Abort call for an HTTP request ends each unfinished choice with finish_reason "abort",
    as gRPC sends FINISH_REASON_ABORT, and counts it aborted, not ok nor goodput."""
    cluster = _ByPromptLength(pace_s=0.2)
    gateway = _gateway(cluster, served_demo)
    body = {"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 6, "n": 2}
    with both_doors(gateway, timeout_s=60) as (http, stub):
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            events = _events(response.iter_lines())
            first = json.loads(next(events))
            assert stub.Abort(pb.AbortRequest(request_id=first["id"])).aborted
            rest = list(events)
        assert rest[-1] == "[DONE]"
        chunks = [json.loads(event) for event in rest[:-1]]
        finish_reasons = {c["index"]: c["finish_reason"] for k in chunks for c in k["choices"]}
        assert finish_reasons == {0: "abort", 1: "abort"}

        outcome: list[httpx.Response] = []
        whole = threading.Thread(
            target=lambda: outcome.append(http.post("/v1/completions", json=body))
        )
        whole.start()
        deadline = time.monotonic() + 10
        while len(cluster.request_ids) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        request_id = cluster.request_ids[-1].removesuffix("-0")  # "<response id>-<prompt>"
        assert stub.Abort(pb.AbortRequest(request_id=request_id)).aborted
        whole.join(timeout=30)
        choices = outcome[0].json()["choices"]
        assert [c["finish_reason"] for c in choices] == ["abort", "abort"]
        _wait_until_idle(gateway)
    assert _requests_by_status(gateway) == {"aborted": 2.0}
    assert _value(gateway, "pdserve:slo_met_total") == 0


def test_an_unexpected_error_mid_stream_ends_the_stream_and_is_counted(
    served_demo: ServedModel,
) -> None:
    """Not only a cluster failure: any error after the 200 is the stream's last event before
    [DONE], counted failed (it reset the connection, counted nowhere). Whole, it is a 500 after
    which the connection serves on (the next request on it was reset)."""
    gateway = _gateway(_Broken(pace_s=0.01), served_demo)
    with both_doors(gateway, timeout_s=60) as (http, _):
        body = {"prompt": "hi", "max_tokens": 6, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            events = list(_events(response.iter_lines()))
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "internal_error" and "a bug" in error["message"]
        whole = http.post("/v1/completions", json={**body, "stream": False})
        assert whole.status_code == 500 and whole.json()["error"]["type"] == "internal_error"
        assert http.post("/v1/completions", json={**body, "max_tokens": 2}).status_code == 200
        _wait_until_idle(gateway)
    assert _requests_by_status(gateway) == {"failed": 2.0, "ok": 1.0}


def test_a_request_the_workers_refuse_is_a_400_naming_the_limit(served_demo: ServedModel) -> None:
    """n above the workers' max_num_seqs (which the gateway's max_n does not know): a 400 with
    the worker's message, never the Ray traceback (it was a 500 with one), counted invalid; the
    server serves on."""
    gateway = _gateway(_Refusing(pace_s=0.0), served_demo)
    message = "n (8) must be <= max_num_seqs (4)"
    with both_doors(gateway, timeout_s=60) as (http, stub):
        body = {"prompt": "hi", "max_tokens": 2, "n": 8}
        whole = http.post("/v1/completions", json=body)
        assert whole.status_code == 400
        assert whole.json()["error"]["message"] == message
        assert whole.json()["error"]["type"] == "invalid_request_error"
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            events = list(_events(response.iter_lines()))
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["message"] == message
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(pb.GenerateRequest(text="hi", max_tokens=2, n=8)))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == message
        assert http.post("/v1/completions", json={**body, "n": 4}).status_code == 200
        _wait_until_idle(gateway)
    assert _requests_by_status(gateway) == {"invalid": 3.0, "ok": 1.0}


def test_metrics_polls_without_a_key_are_not_counted_as_requests(
    served_demo: ServedModel,
) -> None:
    """``requests_total`` counts generation requests: the dashboard's first /metrics poll
    without its key is no unauthorized request (it swelled the backlog advice's denominator)."""
    gateway = _gateway(ScriptedCluster(pace_s=0.0), served_demo, ApiKeys(["sk-test-0123456789"]))
    with both_doors(gateway, timeout_s=60) as (http, _):
        assert http.get("/metrics").status_code == 401
        assert http.get("/v1/models").status_code == 401
        assert http.post("/v1/completions", json={"prompt": "hi"}).status_code == 401
    assert _requests_by_status(gateway) == {"unauthorized": 1.0}


def test_grpc_calls_that_generate_nothing_are_not_counted_as_requests(
    served_demo: ServedModel,
) -> None:
    """As HTTP's /v1/models: a ListModels or Abort call without a valid key is refused but is
    no generation request (each counted unauthorized); a Generate without one is."""
    gateway = _gateway(ScriptedCluster(pace_s=0.0), served_demo, ApiKeys(["sk-test-0123456789"]))
    wrong = (("authorization", "Bearer sk-wrong"),)
    with both_doors(gateway, timeout_s=60) as (_, stub):
        for call in (
            lambda: stub.ListModels(pb.ListModelsRequest(), metadata=wrong),
            lambda: stub.Abort(pb.AbortRequest(request_id="gen-x"), metadata=wrong),
            lambda: stub.ListModels(pb.ListModelsRequest()),
            lambda: list(stub.Generate(pb.GenerateRequest(text="hi"), metadata=wrong)),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _requests_by_status(gateway) == {"unauthorized": 1.0}


def test_a_grpc_call_whose_deadline_passes_while_parsed_is_counted_aborted(
    served_demo: ServedModel,
) -> None:
    """A client that gives up while its request is parsed is counted aborted, as HTTP counts
    one that leaves then (the call was counted nowhere)."""
    limits = RequestLimits(max_model_len=served_demo.max_model_len)
    gateway = _SlowParseGateway(ScriptedCluster(pace_s=0.0), served_demo, limits, ApiKeys([]))
    with both_doors(gateway, timeout_s=60) as (_, stub):
        with pytest.raises(grpc.RpcError) as raised:
            list(stub.Generate(pb.GenerateRequest(text="hi"), timeout=PARSE_S / 3))
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 10
        while not _requests_by_status(gateway) and time.monotonic() < deadline:
            time.sleep(0.02)
        _wait_until_idle(gateway)
    assert _requests_by_status(gateway) == {"aborted": 1.0}


def test_a_client_gone_while_its_body_is_read_is_aborted_not_failed(
    served_demo: ServedModel,
) -> None:
    """A client that closes its connection before the body it announced has arrived (a short
    client timeout under load) ends as aborted: it was counted failed, answered 500 and logged
    as an ASGI traceback."""
    gateway = _gateway(ScriptedCluster(0.01), served_demo)
    with both_doors(gateway, timeout_s=60) as (http, _):
        host, port = str(http.base_url).removeprefix("http://").rstrip("/").rsplit(":", 1)
        body = b'{"model": "pdserve-demo", "prompt": "The os module", "max_tokens": 8}'
        with socket.create_connection((host, int(port))) as client:
            client.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body) + 100, body)  # 100 bytes short
            )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not _value(
            gateway, "pdserve:requests_total", status="aborted"
        ):
            time.sleep(0.02)
        assert _value(gateway, "pdserve:requests_total", status="aborted") == 1
        assert _value(gateway, "pdserve:requests_total", status="failed") == 0
