"""A scripted ``GenerationBackend`` for gateway tests: it records what it was asked and answers
every sample with the tokens a test chooses, so the real tokenizer and gateway run around it.
Asked for logprobs, each token has made-up ones (``scripted_logprobs``); asked for prompt
logprobs, it sends ``scripted_prompt_logprobs`` on the first token, as the workers do.

Also what the gateway tests over it share: the requests they send (``post_json``,
``stream_chunks``, ``bad_request_error``), both front doors of a gateway (``both_doors``) and
two fixtures, ``model`` (the demo model) and
``http`` (a client of a gateway over the test module's own ``cluster`` fixture; one per module:
``module_gateway_client``). A test module imports the fixtures by their functions' names,
``demo_model`` and ``scripted_gateway_client`` (or ``module_gateway_client``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from engine.messages import TokenEvent
from engine.sampling import PromptTokenLogprobs, SamplingParams, TokenLogprobs
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.gateway.auth import ApiKeys
from router.gateway.first_token_log import FirstTokenLog
from router.gateway.limits import RequestLimits
from router.gateway.served_model import ServedModel
from router.gateway.server import GatewayServer
from router.gateway.service import ClusterBackend, Gateway
from router.latency_forecast import AllowedWorkers
from tests.gateway.one_live_worker import OneLiveWorker

DEMO_MODEL = Path(__file__).resolve().parents[2] / "engine" / "demo_model" / "assets"
USER_HI = {"role": "user", "content": "hi"}  # a chat message from the user


class ScriptedCluster(OneLiveWorker):
    """Answers every sample with ``tokens``, the last one ending it with ``finish_reason``."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        super().__init__()
        self.tokens: list[int] = list(tokens)  # output token ids, answered to every sample
        self.finish_reason = "length"
        self.prompts: list[list[int]] = []  # prompt token ids, as asked
        self.params: list[SamplingParams] = []  # sampling params, as asked
        self.priorities: list[int] = []  # request priorities, as asked
        self.request_ids: list[str] = []  # the prompts' ids, as asked
        self.first_prompt_logprob: float | None = None  # replaces position 1's logprob when set

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
        self.prompts.append(list(prompt_token_ids))
        self.params.append(params)
        self.priorities.append(priority)
        self.request_ids.append(request_id or "")
        num_tokens = min(params.max_tokens or len(self.tokens), len(self.tokens))
        for position in range(num_tokens):
            finish = None
            if position == num_tokens - 1:
                finish = self.finish_reason if num_tokens == len(self.tokens) else "length"
            for sample in range(params.n):
                token = self.tokens[position]
                prompt_logprobs = None
                if position == 0 and sample == 0 and params.prompt_logprobs is not None:
                    prompt_logprobs = scripted_prompt_logprobs(
                        prompt_token_ids, params.prompt_logprobs, self.first_prompt_logprob
                    )
                logprobs = None
                if params.logprobs is not None:
                    logprobs = scripted_logprobs(token, position, params.logprobs)
                yield TokenEvent(
                    request_id or "",
                    sample,
                    position,
                    token,
                    logprobs,
                    finish,
                    prompt_logprobs=prompt_logprobs,
                )
            await asyncio.sleep(0)


SCRIPTED_TOP_TOKEN_ID = 900  # the scripted top tokens are 901, 902 ...


def scripted_logprobs(token: int, position: int, num_top: int) -> TokenLogprobs:
    """Made-up logprobs of an output token: -(position + 1) / 4, the most likely, then 901 ..."""
    logprob = -(position + 1) / 4
    top_ids = [token, *(SCRIPTED_TOP_TOKEN_ID + j for j in range(1, num_top))]
    top_lps = [logprob - j for j in range(num_top)]
    return TokenLogprobs(token, logprob, 1, tuple(top_ids[:num_top]), tuple(top_lps))


def scripted_prompt_logprobs(
    prompt_token_ids: Sequence[int], num_top: int, first_logprob: float | None = None
) -> PromptTokenLogprobs:
    """Made-up prompt logprobs of every position from 1: position p's token has logprob -p / 2.
    At odd positions it is the most likely token (rank 1, first of the top ``num_top``, then
    901, 902 ...); at even ones it is not among them (rank num_top + 5) and 901, 902 ... are,
    each more likely.
    ``first_logprob`` replaces position 1's logprob (and its top logprobs) when set."""
    token_ids, logprobs, ranks, top_ids, top_logprobs = [], [], [], [], []
    for position in range(1, len(prompt_token_ids)):
        token = prompt_token_ids[position]
        logprob = -position / 2 if position > 1 or first_logprob is None else first_logprob
        others = [SCRIPTED_TOP_TOKEN_ID + j for j in range(1, num_top + 1)]
        if position % 2:
            ids = [token, *others][:num_top]
            lps = [logprob - j for j in range(num_top)]
            rank = 1
        else:
            ids = others
            lps = [logprob * (j + 1) / (num_top + 1) for j in range(num_top)]
            rank = num_top + 5
        token_ids.append(token)
        logprobs.append(logprob)
        ranks.append(rank)
        top_ids.append(tuple(ids))
        top_logprobs.append(tuple(lps))
    return PromptTokenLogprobs(
        first_position=1,
        token_ids=tuple(token_ids),
        logprobs=tuple(logprobs),
        ranks=tuple(ranks),
        top_token_ids=tuple(top_ids),
        top_logprobs=tuple(top_logprobs),
    )


@contextlib.contextmanager
def http_client(
    cluster: ClusterBackend,
    model: ServedModel,
    limits: RequestLimits | None = None,
    first_token_log: FirstTokenLog | None = None,
) -> Iterator[httpx.Client]:
    """A client of a gateway serving ``model`` over ``cluster`` (a ``ScriptedCluster``, or a
    real router), without API keys (``limits`` default: the model's context, the rest as
    RequestLimits' defaults)."""
    limits = limits or RequestLimits(max_model_len=model.max_model_len)
    gateway = Gateway(cluster, model, limits, ApiKeys([]), first_token_log=first_token_log)
    server = GatewayServer(gateway, "127.0.0.1", 0, None)
    server.start()
    try:
        with httpx.Client(base_url=server.http_url, timeout=30) as client:
            yield client
    finally:
        server.stop()


@contextlib.contextmanager
def both_doors(
    gateway: Gateway, timeout_s: float = 30.0
) -> Iterator[tuple[httpx.Client, pb_grpc.GenerationStub]]:
    """An HTTP client (of ``timeout_s``) and a gRPC stub of ``gateway``, served on free ports
    until the end."""
    server = GatewayServer(gateway, "127.0.0.1", 0, 0)
    server.start()
    try:
        with (
            httpx.Client(base_url=server.http_url, timeout=timeout_s) as http,
            grpc.insecure_channel(server.grpc_target) as channel,
        ):
            yield http, pb_grpc.GenerationStub(channel)
    finally:
        server.stop()


@pytest.fixture(scope="module", name="model")
def demo_model() -> ServedModel:
    """The demo model, served as "pdserve-demo": its real tokenizer runs around the script."""
    return ServedModel.load(str(DEMO_MODEL), "pdserve-demo", None)


@pytest.fixture(name="http")
def scripted_gateway_client(cluster: ScriptedCluster, model: ServedModel) -> Iterator[httpx.Client]:
    """A client of a gateway serving ``model`` over the test module's own ``cluster`` fixture."""
    with http_client(cluster, model) as client:
        yield client


@pytest.fixture(scope="module", name="http")
def module_gateway_client(cluster: ScriptedCluster, model: ServedModel) -> Iterator[httpx.Client]:
    """``http`` for a module whose ``cluster`` and ``model`` fixtures are module-scoped: one
    gateway for all its tests."""
    with http_client(cluster, model) as client:
        yield client


def post_json(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The JSON answer to POSTing ``body`` to ``path``, which must be a 200."""
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def stream_chunks(
    http: httpx.Client, path: str, body: dict[str, Any], *, include_usage: bool = False
) -> list[dict[str, Any]]:
    """The chunks of ``body`` streamed from ``path`` (a 200), in order, without the closing
    [DONE]; with ``include_usage`` the stream is asked for its usage chunk too."""
    stream_body = {**body, "stream": True}
    if include_usage:
        stream_body["stream_options"] = {"include_usage": True}
    with http.stream("POST", path, json=stream_body) as response:
        assert response.status_code == 200, response.read()
        payloads = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def bad_request_error(response: httpx.Response) -> dict[str, Any]:
    """The ``error`` object of ``response``, which must be a 400."""
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


def script_answer(
    cluster: ScriptedCluster, model: ServedModel, text: str, stop: bool = True
) -> None:
    """Script ``text``, ended by eos (finish_reason "stop") or by max_tokens ("length")."""
    script_tokens(cluster, list(model.tokenizer.encode(text)), model, stop)


def script_tokens(
    cluster: ScriptedCluster, token_ids: list[int], model: ServedModel, stop: bool = True
) -> None:
    """Script ``token_ids``, ended by eos (finish_reason "stop") or by max_tokens ("length")."""
    cluster.tokens = [*token_ids, model.tokenizer.eos_token_id] if stop else token_ids
    cluster.finish_reason = "stop" if stop else "length"


def one_token_per_character(model: ServedModel, text: str) -> list[int]:
    """Tokens that decode to ``text``, one per character: each reaches the stream alone."""
    token_ids = []
    for char in text:
        (token_id,) = model.tokenizer.encode(char)
        token_ids.append(token_id)
    assert model.tokenizer.decode(token_ids) == text
    return token_ids
