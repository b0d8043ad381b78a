"""The SSE client against scripted replies (httpx's in-process transport): text chunks,
usage, [DONE], HTTP errors, error events and cut-off streams."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx

from bench.serving.client import EndpointConfig, chunk_text, request_body, stream_request
from bench.serving.metrics import RequestRecord
from bench.serving.workloads import BenchRequest

REQUEST = BenchRequest(index=3, prompt="hello there", prompt_len=2, output_len=3)


def _sse(*events: dict[str, Any] | str) -> bytes:
    lines = [e if isinstance(e, str) else json.dumps(e) for e in events]
    return b"".join(f"data: {line}\n\n".encode() for line in lines)


def _completion(text: str, usage: dict[str, int] | None = None) -> dict[str, Any]:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text}], "usage": usage}


def _run(
    reply: Callable[[httpx.Request], httpx.Response], config: EndpointConfig | None = None
) -> tuple[RequestRecord, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return reply(request)

    config = config or EndpointConfig("http://server/v1", "m", api_key="sk-1")

    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await stream_request(client, config, REQUEST, lambda text: len(text), 0.0)

    return asyncio.run(go()), seen


def test_request_body_asks_for_a_stream_with_usage_and_exact_length() -> None:
    config = EndpointConfig("http://h/v1", "m")
    body = request_body(config, REQUEST)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 3 and body["ignore_eos"] is True and body["temperature"] == 0
    assert body["prompt"] == "hello there"
    chat = request_body(EndpointConfig("http://h/v1", "m", endpoint="chat"), REQUEST)
    assert chat["messages"] == [{"role": "user", "content": "hello there"}]
    assert "prompt" not in chat
    assert (
        EndpointConfig("http://h/v1/", "m", endpoint="chat").url == "http://h/v1/chat/completions"
    )


def test_streamed_completion_is_timed_and_counted_from_usage() -> None:
    usage = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    body = _sse(_completion("a"), _completion(""), _completion("bc"), _completion("d"))
    body += _sse({"choices": [], "usage": usage}, "[DONE]")
    record, seen = _run(lambda _: httpx.Response(200, content=body))
    assert seen[0].headers["authorization"] == "Bearer sk-1"
    assert seen[0].url == "http://server/v1/completions"
    assert record.success and record.error == ""
    assert record.output_tokens == 3 and record.output_tokens_source == "usage"
    assert record.ttft_s is not None and 0 <= record.ttft_s <= record.e2e_s
    assert len(record.itl_s) == 3  # four tokens' chunks, the empty one's too; usage is none


def test_chunks_without_text_time_their_tokens() -> None:
    """A chunk with a choice and no text (a special token skipped, part of a character) is that
    token's arrival, as vLLM's benchmark counts it: a reply whose tokens show no text at all
    still has a TTFT. Under return_token_ids a chunk that says it has no token is none."""
    silent = _sse(_completion(""), _completion(""), "[DONE]")
    record, _ = _run(lambda _: httpx.Response(200, content=silent))
    assert record.success and record.ttft_s is not None and len(record.itl_s) == 1
    config = EndpointConfig("http://server/v1", "m", return_token_ids=True)

    def piece(text: str, ids: list[int]) -> dict[str, Any]:
        return {"choices": [{"index": 0, "text": text, "token_ids": ids}]}

    body = _sse(piece("", [7]), piece("ab", [8]), piece("", []), piece("", [9]), "[DONE]")
    record, seen = _run(lambda _: httpx.Response(200, content=body), config)
    assert json.loads(seen[0].content)["return_token_ids"] is True
    assert record.success and record.ttft_s is not None
    assert len(record.itl_s) == 2  # three chunks with a token; the one with none is no gap


def test_without_usage_the_tokenizer_counts_the_output() -> None:
    config = EndpointConfig("http://server/v1", "m", endpoint="chat")
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    pieces = [{"choices": [{"index": 0, "delta": {"content": t}}]} for t in ("ab", "", "cde")]
    body = _sse(role, *pieces, "[DONE]")
    record, seen = _run(lambda _: httpx.Response(200, content=body), config)
    assert seen[0].url == "http://server/v1/chat/completions"
    assert record.success and record.output_tokens == 5  # len("abcde") with the test counter
    # the role chunk is no token; the empty content's is
    assert record.output_tokens_source == "tokenizer" and len(record.itl_s) == 2


def test_http_errors_fail_the_request_with_their_message() -> None:
    error = {"error": {"message": "model 'x' not found", "type": "invalid_request_error"}}
    record, _ = _run(lambda _: httpx.Response(404, json=error))
    assert not record.success
    assert record.error == "HTTP 404: model 'x' not found"
    record, _ = _run(lambda _: httpx.Response(502, content=b"bad gateway"))
    assert record.error == "HTTP 502: bad gateway"


def test_error_events_and_cut_streams_fail_the_request() -> None:
    body = _sse(_completion("a"), {"error": {"message": "worker died"}}, "[DONE]")
    record, _ = _run(lambda _: httpx.Response(200, content=body))
    assert not record.success and record.error == "error event: worker died"
    record, _ = _run(lambda _: httpx.Response(200, content=_sse(_completion("a"))))
    assert not record.success and "without data: [DONE]" in record.error


def test_transport_errors_fail_the_request() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    record, _ = _run(refuse)
    assert not record.success and record.error.startswith("ConnectError")


def test_chunk_text_reads_every_choice() -> None:
    two = {"choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}]}
    assert chunk_text(two, "completions") == "ab"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}, "chat") == ""
    assert chunk_text({"choices": [], "usage": {}}, "completions") == ""
