"""A scripted ``GenerationBackend`` for gateway tests: it records what it was asked and answers
every sample with the tokens a test chooses, so the real tokenizer and gateway run around it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Iterator, Sequence

import httpx

from engine.messages import TokenEvent
from engine.sampling import SamplingParams
from router.gateway.auth import ApiKeys
from router.gateway.limits import RequestLimits
from router.gateway.served_model import ServedModel
from router.gateway.server import GatewayServer
from router.gateway.service import Gateway
from tests.gateway.one_live_worker import OneLiveWorker


class ScriptedCluster(OneLiveWorker):
    """Answers every sample with ``tokens``, the last one ending it with ``finish_reason``."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finish_reason = "length"
        self.prompts: list[list[int]] = []  # prompt token ids, as asked
        self.params: list[SamplingParams] = []  # sampling params, as asked

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[TokenEvent, None]:
        self.prompts.append(list(prompt_token_ids))
        self.params.append(params)
        num_tokens = min(params.max_tokens or len(self.tokens), len(self.tokens))
        for position in range(num_tokens):
            finish = None
            if position == num_tokens - 1:
                finish = self.finish_reason if num_tokens == len(self.tokens) else "length"
            for sample in range(params.n):
                token = self.tokens[position]
                yield TokenEvent(request_id or "", sample, position, token, None, finish)
            await asyncio.sleep(0)


@contextlib.contextmanager
def http_client(cluster: ScriptedCluster, model: ServedModel) -> Iterator[httpx.Client]:
    """A client of a gateway serving ``model`` over ``cluster``, without API keys."""
    gateway = Gateway(cluster, model, RequestLimits(max_model_len=model.max_model_len), ApiKeys([]))
    server = GatewayServer(gateway, "127.0.0.1", 0, None)
    server.start()
    try:
        with httpx.Client(base_url=server.http_url, timeout=30) as client:
            yield client
    finally:
        server.stop()
