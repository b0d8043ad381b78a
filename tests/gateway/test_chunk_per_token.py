"""One streamed chunk per generated token on both front doors, as vLLM streams them: a token
whose text is empty (an eos under ``ignore_eos``, a special token skipped) has its own chunk
(chat: ``content: ""``), with its own logprobs, so a client that counts or times chunks per
token sees each one. Text held back (part of a multi-byte character, never sent broken, or what
may begin a stop string) leaves with the chunk of the token that completes it; the tokens before
that have their chunks at once, their text empty, as vLLM's completions and chat send them.

The cluster is a scripted ``GenerationBackend`` that answers the tokens a test chooses; the
demo model's real byte-level BPE tokenizer runs around it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncGenerator, Iterator, Sequence
from typing import Any

import grpc
import httpx
import pytest

from engine.messages import TokenEvent
from engine.sampling.params import SamplingParams
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.gateway.auth import ApiKeys
from router.gateway.limits import RequestLimits
from router.gateway.served_model import ServedModel
from router.gateway.server import GatewayServer
from router.gateway.service import Gateway
from tests.gateway.token_script import (
    DEMO_MODEL,
    USER_HI,
    ScriptedCluster,
    demo_model,  # noqa: F401 - the model fixture
    http_client,
    one_token_per_character,
    post_json,
    script_answer,
    script_tokens,
    stream_chunks,
)

pytestmark = pytest.mark.timeout(120)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
NUM_EOS = 57  # the user's case: " stack", then 57 eos tokens under ignore_eos
MULTI_BYTE = "naïve 😀 café 世界"
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def cluster() -> ScriptedCluster:
    return ScriptedCluster()


@pytest.fixture(scope="module")
def server(cluster: ScriptedCluster, model: ServedModel) -> Iterator[GatewayServer]:
    """A gateway over ``cluster`` with both front doors, HTTP and gRPC."""
    limits = RequestLimits(max_model_len=model.max_model_len)
    server = GatewayServer(Gateway(cluster, model, limits, ApiKeys([])), "127.0.0.1", 0, 0)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(server: GatewayServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.http_url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def stub(server: GatewayServer) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield pb_grpc.GenerationStub(channel)


def _stack_then_eos(cluster: ScriptedCluster, model: ServedModel) -> list[int]:
    """Script " stack" then NUM_EOS eos tokens, ended by max_tokens; the tokens."""
    (stack,) = model.tokenizer.encode(" stack")
    token_ids = [stack, *[model.tokenizer.eos_token_id] * NUM_EOS]
    script_tokens(cluster, token_ids, model, stop=False)
    return token_ids


def _multi_byte(cluster: ScriptedCluster, model: ServedModel) -> list[int]:
    """Script MULTI_BYTE (characters of 2 to 4 byte tokens each) with an eos first and one
    inside the emoji; the tokens."""
    eos = model.tokenizer.eos_token_id
    token_ids = [eos, *model.tokenizer.encode(MULTI_BYTE)]
    emoji = len(model.tokenizer.encode(MULTI_BYTE[: MULTI_BYTE.index("😀")])) + 1
    token_ids.insert(emoji + 1, eos)  # after the emoji's first byte
    assert model.tokenizer.decode(token_ids[: emoji + 2], skip_special_tokens=True).endswith(
        REPLACEMENT
    )
    script_tokens(cluster, token_ids, model, stop=False)
    return token_ids


def _choices(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chunks' choices, one per chunk, without chat's role chunk and the usage chunk."""
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    if choices and choices[0].get("delta") == {"role": "assistant", "content": ""}:
        return choices[1:]
    return choices


def _generate(stub: pb_grpc.GenerationStub, **fields: Any) -> list[pb.Chunk]:
    responses = list(stub.Generate(pb.GenerateRequest(text="hi", **fields), timeout=60))
    assert responses[0].WhichOneof("event") == "started"
    assert responses[-1].WhichOneof("event") == "usage"
    assert all(r.WhichOneof("event") == "chunk" for r in responses[1:-1])
    return [r.chunk for r in responses[1:-1]]


# ---------------------------------------------------------------- empty text, one chunk each


def test_completions_stream_one_event_per_token_empty_text_included(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    token_ids = _stack_then_eos(cluster, model)
    body = {"prompt": "hi", "max_tokens": len(token_ids), "ignore_eos": True}
    chunks = stream_chunks(http, COMPLETIONS, body, include_usage=True)
    choices = _choices(chunks)
    assert len(choices) == len(token_ids) == NUM_EOS + 1
    assert [c["text"] for c in choices] == [" stack"] + [""] * NUM_EOS
    assert [c["finish_reason"] for c in choices] == [None] * NUM_EOS + ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == len(token_ids)
    whole = post_json(http, COMPLETIONS, body)  # unchanged
    assert whole["choices"][0]["text"] == " stack"
    assert whole["usage"]["completion_tokens"] == len(token_ids)


def test_chat_stream_one_event_per_token_with_empty_content(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    token_ids = _stack_then_eos(cluster, model)
    body = {"messages": [USER_HI], "max_tokens": len(token_ids), "ignore_eos": True}
    chunks = stream_chunks(http, CHAT, body, include_usage=True)
    choices = _choices(chunks)
    assert len(choices) == len(token_ids)
    # each token's delta, as vLLM sends it; the last one ends the choice
    expected = [{"content": " stack"}] + [{"content": ""}] * (NUM_EOS - 1) + [{}]
    assert [c["delta"] for c in choices] == expected
    assert choices[-1]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == len(token_ids)


def test_each_chunk_carries_its_own_tokens_logprobs(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    """The scripted logprob of the token at position p is -(p + 1) / 4."""
    token_ids = _stack_then_eos(cluster, model)
    expected = [-(p + 1) / 4 for p in range(len(token_ids))]
    token_texts = [model.tokenizer.decode([t]) for t in token_ids]
    body = {"prompt": "hi", "max_tokens": len(token_ids), "logprobs": 1}
    choices = _choices(stream_chunks(http, COMPLETIONS, body))
    assert [c["logprobs"]["tokens"] for c in choices] == [[t] for t in token_texts]
    assert [c["logprobs"]["token_logprobs"] for c in choices] == [[lp] for lp in expected]
    body = {"messages": [USER_HI], "max_tokens": len(token_ids), "logprobs": True}
    choices = _choices(stream_chunks(http, CHAT, body))
    assert [[e["logprob"] for e in c["logprobs"]["content"]] for c in choices] == [
        [lp] for lp in expected
    ]
    assert [[e["token"] for e in c["logprobs"]["content"]] for c in choices] == [
        [t] for t in token_texts
    ]


def test_grpc_streams_one_chunk_per_token_with_its_logprobs(
    stub: pb_grpc.GenerationStub, cluster: ScriptedCluster, model: ServedModel
) -> None:
    token_ids = _stack_then_eos(cluster, model)
    chunks = _generate(stub, max_tokens=len(token_ids), ignore_eos=True, logprobs=1)
    assert [list(c.token_ids) for c in chunks] == [[t] for t in token_ids]
    assert [c.text for c in chunks] == [" stack"] + [""] * NUM_EOS
    assert [[lp.token_id for lp in c.logprobs] for c in chunks] == [[t] for t in token_ids]
    assert [[lp.logprob for lp in c.logprobs] for c in chunks] == [
        [-(p + 1) / 4] for p in range(len(token_ids))
    ]
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH


class _HeldFirstToken(ScriptedCluster):
    """Answers as scripted once ``release`` is set; ``asked`` is set when a prompt arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = threading.Event()
        self.release = threading.Event()

    async def generate(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, **options: Any
    ) -> AsyncGenerator[TokenEvent, None]:
        self.asked.set()
        await asyncio.to_thread(self.release.wait, 120)
        async for event in super().generate(prompt_token_ids, params, **options):
            yield event


def test_a_chat_streams_its_role_chunk_with_its_first_token(model: ServedModel) -> None:
    """As vLLM sends it: a client that times its first chunk (vLLM's benchmark, say) times the
    first token, not the response's start. No chunk leaves while the prompt's first token is
    held, though the response's headers have."""
    cluster = _HeldFirstToken()
    script_answer(cluster, model, "Hello")
    received: list[tuple[bool, str]] = []  # (first token released by then, the data line)
    headers = threading.Event()
    body = {"messages": [USER_HI], "max_tokens": 8, "stream": True}
    with http_client(cluster, model) as http:

        def read() -> None:
            with http.stream("POST", CHAT, json=body) as response:
                headers.set()
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        received.append((cluster.release.is_set(), line[6:]))

        reader = threading.Thread(target=read)
        reader.start()
        assert cluster.asked.wait(60) and headers.wait(60)
        time.sleep(0.5)  # a chunk sent at the start has had time to arrive
        cluster.release.set()
        reader.join(60)
    assert received and all(released for released, _ in received)
    chunks = [json.loads(line) for _, line in received[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello"


def test_continuous_usage_stats_give_every_chunk_its_choices_usage_so_far(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    """vLLM's ``stream_options.continuous_usage_stats``: each chunk carries its choice's usage
    so far (its prompt's tokens; its own completion tokens, 0 in chat's role chunk); the usage
    chunk the request's totals. Without it the chunks' usage is null; without include_usage
    there is none."""
    _stack_then_eos(cluster, model)
    options = {"include_usage": True, "continuous_usage_stats": True}
    for path, body, num_prompts in (
        (COMPLETIONS, {"prompt": ["hi", "hello there"]}, 2),
        (CHAT, {"messages": [USER_HI]}, 1),
    ):
        body = {**body, "n": 2, "max_tokens": 5, "stream_options": options}
        *chunks, totals = stream_chunks(http, path, body)
        assert totals["choices"] == [] and totals["usage"]["completion_tokens"] == num_prompts * 10
        streamed = dict.fromkeys(range(2 * num_prompts), 0)
        prompts: dict[int, int] = {}
        for chunk in chunks:
            (choice,) = chunk["choices"]
            index, usage = choice["index"], chunk["usage"]
            if "role" not in choice.get("delta", {}):
                streamed[index] += 1
            assert usage["completion_tokens"] == streamed[index], (path, chunk)
            assert usage["total_tokens"] == usage["prompt_tokens"] + streamed[index]
            assert prompts.setdefault(index, usage["prompt_tokens"]) == usage["prompt_tokens"]
        assert set(streamed.values()) == {5}
        per_prompt = [prompts[2 * i] for i in range(num_prompts)]  # a prompt's 2 choices agree
        assert [prompts[2 * i + 1] for i in range(num_prompts)] == per_prompt
        assert sum(per_prompt) == totals["usage"]["prompt_tokens"]
    plain = stream_chunks(http, COMPLETIONS, {"prompt": "hi", "max_tokens": 2}, include_usage=True)
    assert all(chunk["usage"] is None for chunk in plain[:-1])
    unasked = {"prompt": "hi", "max_tokens": 2, "stream_options": {"continuous_usage_stats": True}}
    assert all("usage" not in chunk for chunk in stream_chunks(http, COMPLETIONS, unasked))


# ---------------------------------------------------------------- text held back


def test_a_split_character_arrives_whole_in_the_chunk_of_its_last_byte(
    http: httpx.Client, cluster: ScriptedCluster, model: ServedModel
) -> None:
    """Every token has its chunk at once, with its own logprobs; the tokens of a character's
    first bytes (and the eos among them) have empty text, and the chunk of its last byte holds
    it whole."""
    token_ids = _multi_byte(cluster, model)
    for path, body in (
        (COMPLETIONS, {"prompt": "hi", "logprobs": 1}),
        (CHAT, {"messages": [USER_HI], "logprobs": True}),
    ):
        choices = _choices(stream_chunks(http, path, {**body, "max_tokens": len(token_ids)}))
        if path == COMPLETIONS:
            texts = [c["text"] for c in choices]
            num_tokens = [len(c["logprobs"]["tokens"]) for c in choices]
        else:
            texts = [c["delta"].get("content", "") for c in choices]
            num_tokens = [len(c["logprobs"]["content"]) for c in choices]
        assert "".join(texts) == MULTI_BYTE
        assert not any(REPLACEMENT in text for text in texts)
        assert num_tokens == [1] * len(token_ids)
        for char in "ï😀é世界":
            assert sum(char in text for text in texts) == 1, char
        (emoji_chunk,) = [i for i, text in enumerate(texts) if "😀" in text]
        assert texts[emoji_chunk] == "😀"
        assert texts[emoji_chunk - 4 : emoji_chunk] == [""] * 4  # its 3 bytes and the eos


def test_grpc_sends_a_chunk_per_token_of_a_split_character(
    stub: pb_grpc.GenerationStub, cluster: ScriptedCluster, model: ServedModel
) -> None:
    token_ids = _multi_byte(cluster, model)
    chunks = _generate(stub, max_tokens=len(token_ids), logprobs=0)
    assert "".join(c.text for c in chunks) == MULTI_BYTE
    assert not any(REPLACEMENT in c.text for c in chunks)
    assert [list(c.token_ids) for c in chunks] == [[t] for t in token_ids]
    assert all(len(c.logprobs) == 1 for c in chunks)
    (emoji,) = [i for i, c in enumerate(chunks) if "😀" in c.text]
    assert [c.text for c in chunks[emoji - 4 : emoji + 1]] == ["", "", "", "", "😀"]


def test_text_that_may_begin_a_stop_string_is_held_while_its_tokens_stream(
    http: httpx.Client, stub: pb_grpc.GenerationStub, cluster: ScriptedCluster, model: ServedModel
) -> None:
    """ "b" may begin the stop string "bx": its chunk and the eos's after it have empty text,
    and "b" leaves with "c", which shows it does not begin one."""
    a, b, c, d = one_token_per_character(model, "abcd")
    eos = model.tokenizer.eos_token_id
    token_ids = [a, eos, b, eos, c, d]
    script_tokens(cluster, token_ids, model, stop=False)
    body = {"prompt": "hi", "max_tokens": len(token_ids), "logprobs": 1, "stop": ["bx"]}
    choices = _choices(stream_chunks(http, COMPLETIONS, body))
    assert [choice["text"] for choice in choices] == ["a", "", "", "", "bc", "d"]
    assert [len(choice["logprobs"]["tokens"]) for choice in choices] == [1] * 6
    chunks = _generate(stub, max_tokens=len(token_ids), stop=["bx"])
    assert [list(chunk.token_ids) for chunk in chunks] == [[t] for t in token_ids]
    assert [chunk.text for chunk in chunks] == ["a", "", "", "", "bc", "d"]


def test_grpc_names_the_stop_string_or_token_that_ended_a_sample(
    stub: pb_grpc.GenerationStub, cluster: ScriptedCluster, model: ServedModel
) -> None:
    """vLLM's stop_reason on the gRPC door: the last Chunk's ``stop_string`` or
    ``stop_token_id``; neither for the tokenizer's eos or max_tokens."""
    a, b, c = one_token_per_character(model, "abc")
    script_tokens(cluster, [a, b, c], model, stop=True)  # then the eos
    last = _generate(stub, max_tokens=8, stop=["xy", "bc"])[-1]
    assert last.finish_reason == pb.FINISH_REASON_STOP
    assert last.WhichOneof("stop_reason") == "stop_string" and last.stop_string == "bc"
    eos_ended = _generate(stub, max_tokens=8)
    assert eos_ended[-1].finish_reason == pb.FINISH_REASON_STOP
    assert all(chunk.WhichOneof("stop_reason") is None for chunk in eos_ended)
    script_tokens(cluster, [a, b, c], model, stop=False)
    cluster.finish_reason = "stop"  # as the workers end a sample on a stop token
    last = _generate(stub, max_tokens=8, stop_token_ids=[c])[-1]
    assert last.WhichOneof("stop_reason") == "stop_token_id" and last.stop_token_id == c
    length_ended = _generate(stub, max_tokens=2)
    assert length_ended[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert all(chunk.WhichOneof("stop_reason") is None for chunk in length_ended)


# ---------------------------------------------------------------- the parsers

GET_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
HERMES_TEXT = (
    'Thinking.</think>\n\nLet me check.\n<tool_call>\n{"name": "get_weather", '
    '"arguments": {"city": "Nice"}}\n</tool_call>'
)


def _put_together(choices: list[dict[str, Any]]) -> tuple[str, str, list[dict[str, str]]]:
    """A stream's reasoning, content and calls ({"name", "arguments"}), as a client puts them
    together; every delta but the last well formed and not empty."""
    reasoning, content = "", ""
    calls: list[dict[str, str]] = []
    for choice in choices:
        delta = choice["delta"]
        assert set(delta) <= {"reasoning", "content", "tool_calls"}, delta
        assert delta or choice["finish_reason"] is not None
        reasoning += delta.get("reasoning", "")
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", []):
            if "id" in entry:
                assert entry["index"] == len(calls) and entry["type"] == "function"
                calls.append({"name": entry["function"]["name"], "arguments": ""})
            else:
                assert set(entry) == {"index", "function"}
            calls[entry["index"]]["arguments"] += entry["function"].get("arguments", "")
    return reasoning, content, calls


def _whole_calls(message: dict[str, Any]) -> list[dict[str, str]]:
    return [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message["tool_calls"]
    ]


def test_tokens_whose_text_the_parsers_hold_have_chunks_of_empty_content(
    cluster: ScriptedCluster,
) -> None:
    """qwen3's reasoning split and hermes tool calls, one token per character: the parsers
    hold each tag's start until it completes; each of those tokens still has its chunk, with
    ``content: ""``, and together the chunks hold the whole response's reasoning, content and
    call."""
    served = ServedModel.load(
        str(DEMO_MODEL), "pdserve-demo", None, tool_call_parser="hermes", reasoning_parser="qwen3"
    )
    script_tokens(cluster, one_token_per_character(served, HERMES_TEXT), served)  # then eos
    body = {"messages": [USER_HI], "tools": [GET_WEATHER], "tool_choice": "auto"}
    with http_client(cluster, served) as http:
        whole = post_json(http, CHAT, body)["choices"][0]
        choices = _choices(stream_chunks(http, CHAT, body))
    assert len(choices) == len(cluster.tokens)
    assert {"content": ""} in [c["delta"] for c in choices]
    reasoning, content, calls = _put_together(choices)
    message = whole["message"]
    assert reasoning == message["reasoning"] == "Thinking."
    assert content == message["content"] == "\n\nLet me check.\n"
    assert calls == _whole_calls(message)
    assert json.loads(calls[0]["arguments"]) == {"city": "Nice"}
    assert choices[-1]["finish_reason"] == whole["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    ("tool_choice", "text"),
    [
        ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Nice"}'),
        ("required", '[{"name": "get_weather", "parameters": {"city": "Nice"}}]'),
    ],
)
def test_empty_tokens_in_a_forced_tool_call_have_chunks_of_empty_content(
    http: httpx.Client,
    cluster: ScriptedCluster,
    model: ServedModel,
    tool_choice: Any,
    text: str,
) -> None:
    """A token of empty text after each token of a constrained call (an eos, skipped as any
    special token is; the workers would have ended the call there): a chunk each, with
    ``content: ""``; the call streams as the whole response has it."""
    token_ids = []
    for token_id in model.tokenizer.encode(text):
        token_ids += [token_id, model.tokenizer.eos_token_id]
    script_tokens(cluster, token_ids, model)  # then eos: "stop"
    body = {"messages": [USER_HI], "tools": [GET_WEATHER], "tool_choice": tool_choice}
    whole = post_json(http, CHAT, body)["choices"][0]
    choices = _choices(stream_chunks(http, CHAT, body))
    assert len(choices) == len(cluster.tokens)
    assert [c["delta"] for c in choices[1:-1:2]] == [{"content": ""}] * (len(token_ids) // 2)
    reasoning, content, calls = _put_together(choices)
    assert (reasoning, content) == ("", "")
    assert calls == _whole_calls(whole["message"])
    assert json.loads(calls[0]["arguments"]) == {"city": "Nice"}
    assert choices[-1]["finish_reason"] == "tool_calls"
