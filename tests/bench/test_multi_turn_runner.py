"""The conversation scheduler against a scripted server (httpx's in-process transport): a turn
is sent only after the previous turn's reply ended, with the previous prompt, the reply's token
ids and the new user tokens as its prompt; conversations start at their Poisson offsets; a
bound on concurrency holds conversations back; a failed turn ends its conversation; servers
that do not return token ids get re-encoded replies."""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.serving.arrivals import ArrivalSpec, send_offsets
from bench.serving.cli import main
from bench.serving.client import EndpointConfig
from bench.serving.conversation_runner import (
    WarmUpError,
    send_conversations,
    warm_up_conversations,
)
from bench.serving.conversations import Conversation, build_conversations
from bench.serving.metrics import RequestRecord
from bench.serving.progress import Progress
from bench.serving.tokens import TokenCodec
from bench.serving.workloads import WorkloadSpec

pytestmark = pytest.mark.timeout(60)

SPEC = WorkloadSpec(
    kind="multi-turn",
    num_conversations=5,
    num_turns=3,
    system_prompt_len=40,
    user_range=(2, 6),
    reply_range=(2, 5),
)


@dataclass
class Seen:
    prompt: list[int]
    max_tokens: int
    arrived: float  # perf_counter() when the request reached the server
    replied: float  # ... and when its reply was complete


@dataclass
class ScriptedServer:
    """Answers each completion after ``delay_s`` with ``max_tokens`` ids derived from the
    prompt (and, unless ``token_ids`` is "none", those ids in each chunk's ``token_ids``)."""

    codec: TokenCodec
    delay_s: float = 0.01
    token_ids: str = "yes"  # "yes" | "none" (ignores the field) | "refuse" (400 naming it)
    fail_prompt: list[int] | None = None  # this prompt gets a 500
    seen: list[Seen] = field(default_factory=list)

    def reply_ids(self, prompt: list[int], max_tokens: int) -> list[int]:
        vocabulary = self.codec.sampleable_token_ids
        return [vocabulary[(len(prompt) * 7 + i) % len(vocabulary)] for i in range(max_tokens)]

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        arrived = time.perf_counter()
        body = json.loads(request.content)
        if body.get("return_token_ids") and self.token_ids == "refuse":
            error = {"error": {"message": "return_token_ids is not supported by this server"}}
            return httpx.Response(400, json=error)
        prompt = body["prompt"]
        await asyncio.sleep(self.delay_s)
        if prompt == self.fail_prompt:
            return httpx.Response(500, json={"error": {"message": "worker died"}})
        ids = self.reply_ids(prompt, body["max_tokens"])
        chunks: list[dict[str, Any]] = []
        for position, token_id in enumerate(ids):
            choice: dict[str, Any] = {"index": 0, "text": self.codec.decode([token_id])}
            if body.get("return_token_ids") and self.token_ids == "yes":
                choice["token_ids"] = [token_id]
                if position == 0:
                    choice["prompt_token_ids"] = prompt
            chunks.append({"choices": [choice]})
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids)}
        chunks.append({"choices": [], "usage": usage})
        content = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks)
        self.seen.append(Seen(prompt, body["max_tokens"], arrived, time.perf_counter()))
        return httpx.Response(200, content=content + b"data: [DONE]\n\n")


@pytest.fixture(scope="module")
def codec(tokenizer_dir: Path) -> TokenCodec:
    return TokenCodec.load(tokenizer_dir)


ENDPOINT = EndpointConfig("http://server/v1", "m")


def _run(
    server: ScriptedServer,
    conversations: list[Conversation],
    arrivals: ArrivalSpec,
    return_token_ids: bool = True,
) -> tuple[list[RequestRecord], float]:
    async def go() -> tuple[list[RequestRecord], float]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as client:
            endpoint = EndpointConfig("http://server/v1", "m", return_token_ids=return_token_ids)
            progress = Progress(5 * 3, enabled=False)
            return await send_conversations(
                client, endpoint, server.codec, conversations, arrivals, 11, progress
            )

    return asyncio.run(go())


def _by_conversation(records: list[RequestRecord]) -> dict[int, list[RequestRecord]]:
    turns: dict[int, list[RequestRecord]] = {}
    for record in records:
        assert record.conversation_id is not None
        turns.setdefault(record.conversation_id, []).append(record)
    return turns


def test_turns_follow_their_replies_and_extend_the_conversation(codec: TokenCodec) -> None:
    server = ScriptedServer(codec)
    conversations = build_conversations(SPEC, codec, seed=0)
    records, duration_s = _run(server, conversations, ArrivalSpec(50.0))
    assert len(records) == 15 and all(r.success for r in records)
    assert [r.index for r in records] == list(range(15))  # workload order
    assert duration_s >= max(r.send_time_s + r.e2e_s for r in records) - 1e-6
    for turns in _by_conversation(records).values():
        assert [r.turn_index for r in turns] == [0, 1, 2]
        for earlier, later in zip(turns, turns[1:]):
            assert later.send_time_s >= earlier.send_time_s + earlier.e2e_s
    # the server saw each turn's prompt as the previous prompt + its reply + new user tokens
    prompts = {tuple(s.prompt): s for s in server.seen}
    for conversation in conversations:
        prompt = conversation.first_prompt()
        for index, turn in enumerate(conversation.turns):
            seen = prompts[tuple(prompt)]
            assert seen.max_tokens == turn.reply_len
            if index + 1 < len(conversation.turns):
                reply = server.reply_ids(prompt, turn.reply_len)
                following = conversation.turns[index + 1]
                prompt = [*prompt, *reply, *following.user_token_ids]
                assert prompts[tuple(prompt)].arrived >= seen.replied
    assert {r.prompt_len for r in records} <= {len(s.prompt) for s in server.seen}


def test_conversations_start_at_their_poisson_offsets(codec: TokenCodec) -> None:
    arrivals = ArrivalSpec(request_rate=40.0)  # Poisson: burstiness 1
    conversations = build_conversations(SPEC, codec, seed=0)
    records, _ = _run(ScriptedServer(codec), conversations, arrivals)
    offsets = send_offsets(arrivals, len(conversations), 11)
    firsts = [turns[0] for _, turns in sorted(_by_conversation(records).items())]
    for first, offset in zip(firsts, offsets):
        assert first.send_time_s >= offset - 1e-3
        assert first.send_time_s < offset + 0.5  # sent on schedule, not after other turns
    assert [f.send_time_s for f in firsts] == sorted(f.send_time_s for f in firsts)


def test_a_concurrency_bound_holds_conversations_back(codec: TokenCodec) -> None:
    arrivals = ArrivalSpec(math.inf, max_concurrency=1)  # a closed loop of one conversation
    records, _ = _run(ScriptedServer(codec), build_conversations(SPEC, codec, seed=0), arrivals)
    turns = _by_conversation(records)
    for conversation_id in range(1, 5):
        previous_end = max(r.send_time_s + r.e2e_s for r in turns[conversation_id - 1])
        assert turns[conversation_id][0].send_time_s >= previous_end


def test_a_failed_turn_ends_its_conversation(codec: TokenCodec) -> None:
    conversations = build_conversations(SPEC, codec, seed=0)
    server = ScriptedServer(codec, fail_prompt=conversations[2].first_prompt())
    records, _ = _run(server, conversations, ArrivalSpec(50.0))
    failed = _by_conversation(records)[2]
    assert [r.success for r in failed] == [False, False, False]
    assert failed[0].error.startswith("HTTP 500")
    assert [r.error for r in failed[1:]] == ["not sent: turn 0 of its conversation failed"] * 2
    assert [r.turn_index for r in failed] == [0, 1, 2] and failed[2].index == 2 * 3 + 2
    assert sum(r.success for r in records) == 12  # the others ran on
    assert len(server.seen) == 4 * 3  # the failed turn got no reply; the later ones were not sent


@pytest.mark.parametrize("support", ["yes", "none", "refuse"])
def test_warm_up_asks_for_token_ids_and_falls_back_to_the_tokenizer(
    codec: TokenCodec, support: str
) -> None:
    server = ScriptedServer(codec, token_ids=support)

    async def go() -> EndpointConfig:
        async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as client:
            return await warm_up_conversations(client, ENDPOINT, codec, SPEC, 2, seed=99)

    endpoint = asyncio.run(go())
    assert endpoint.return_token_ids is (support == "yes")
    assert len(server.seen) == 2  # the probe (asked again without the field if refused) and one
    conversations = build_conversations(SPEC, codec, seed=0)[:1]
    server.seen.clear()
    records, _ = _run(server, conversations, ArrivalSpec(50.0), endpoint.return_token_ids)
    assert all(r.success for r in records[:3])
    conversation = conversations[0]
    first = conversation.first_prompt()
    reply = server.reply_ids(first, conversation.turns[0].reply_len)
    if support != "yes":  # re-encoded from the reply's text, which may merge or split tokens
        reply = codec.encode(codec.decode(reply))
    expected = [*first, *reply, *conversation.turns[1].user_token_ids]
    assert server.seen[1].prompt == expected


def test_a_failing_warm_up_raises(codec: TokenCodec) -> None:
    async def refuse_all(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, json={"error": {"message": "bad key"}})

    async def go() -> EndpointConfig:
        async with httpx.AsyncClient(transport=httpx.MockTransport(refuse_all)) as client:
            return await warm_up_conversations(client, ENDPOINT, codec, SPEC, 1, seed=0)

    with pytest.raises(WarmUpError, match="HTTP 401: bad key"):
        asyncio.run(go())


def test_a_multi_turn_benchmark_reports_turns_and_the_servers_counters(
    codec: TokenCodec, tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``bench.serve --workload multi-turn --server-counters`` end to end over the scripted
    server, which counts the prompt tokens of the prompts it answered on its /metrics page."""
    server = ScriptedServer(codec)

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            num_tokens = sum(len(s.prompt) for s in server.seen)
            page = (
                f"# TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total {num_tokens}\n"
                "# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total 0\n"
            )
            return httpx.Response(200, text=page)
        return await server(request)

    real_client = httpx.AsyncClient
    monkeypatch.setattr(
        httpx,
        "AsyncClient",
        lambda **kw: real_client(transport=httpx.MockTransport(handler), **kw),
    )
    result_json = tmp_path / "multi_turn.json"
    argv = [
        "--base-url=http://server/v1",
        "--model=m",
        f"--tokenizer={tokenizer_dir}",
        "--workload=multi-turn",
        "--num-conversations=4",
        "--num-turns=3",
        "--system-prompt-len=30",
        "--user-range=2,5",
        "--reply-range=2,4",
        "--request-rate=100",
        "--num-warmups=2",
        "--server-counters",
        f"--result-json={result_json}",
        "--no-progress",
    ]
    assert main(argv) == 0
    saved = json.loads(result_json.read_text())
    assert saved["reply_token_ids"] == "server"
    records = saved["records"]
    assert len(records) == 12 and all(r["success"] for r in records)
    assert sorted({r["turn_index"] for r in records}) == [0, 1, 2]
    assert set(saved["per_turn_ttft"]) == {"0", "1", "2"}
    assert saved["per_turn_ttft"]["2"]["count"] == 4
    timed = sum(r["prompt_len"] for r in records)  # the warm-ups are not in the change
    counters = saved["server_counters"]
    assert counters["server"] == "vllm" and counters["prompt_tokens"] == timed
    assert counters["prefill_tokens_computed"] == timed  # no hits on this page
    assert counters["prefix_hit_rate"] == 0.0
    assert saved["summary"]["num_requests"] == 12
