"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

The request goes out as ``POST {base_url}/completions`` (or ``/chat/completions``) with
``stream: true`` and ``stream_options.include_usage``; the reply is read as server-sent events:
``data: {json}`` lines until ``data: [DONE]``. A non-200 status, an ``{"error": ...}`` event, a
stream that ends without ``[DONE]`` or a transport error fails the request. A prompt given as
token ids goes out as a list of ints (completions); with ``return_token_ids`` (vLLM's field,
which pdserve's completions implement too) the chunks' ``token_ids`` make up the reply's token
ids. Every chunk with a choice is a token's arrival, its text empty or not (a special token
skipped, part of a character, text that may begin a stop string), as vLLM's benchmark times
them (AIPerf times only chunks with text): TTFT and the inter-token gaps are the tokens', not
the text's. Not tokens: chat's role chunk (vLLM and pdserve send it with the first token), the
usage chunk (no choices), and a chunk whose ``token_ids`` are empty (an aborted choice's last).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from bench.serving.metrics import RequestRecord
from bench.serving.workloads import BenchRequest

Endpoint = Literal["completions", "chat"]


@dataclass(frozen=True, slots=True)
class EndpointConfig:
    base_url: str  # e.g. http://127.0.0.1:8000/v1
    model: str  # the served model name sent as ``model``
    api_key: str | None = None  # sent as ``Authorization: Bearer``; None sends none
    endpoint: Endpoint = "completions"  # /completions (prompt) or /chat/completions (messages)
    temperature: float = 0.0  # sampling temperature (0 = greedy)
    ignore_eos: bool = True  # generate exactly max_tokens (vLLM and pdserve accept it)
    timeout_s: float = 600.0  # per-request limit on connecting and on each read
    return_token_ids: bool = False  # ask for the reply's token ids (completions)

    @property
    def url(self) -> str:
        path = "chat/completions" if self.endpoint == "chat" else "completions"
        return f"{self.base_url.rstrip('/')}/{path}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def request_body(config: EndpointConfig, request: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": config.model,
        "max_tokens": request.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.return_token_ids:
        body["return_token_ids"] = True
    if request.prompt_token_ids is not None:
        if config.endpoint == "chat":
            raise ValueError("a prompt of token ids is sent to completions only")
        body["prompt"] = list(request.prompt_token_ids)
    elif config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    return body


@dataclass(frozen=True, slots=True)
class Reply:
    """What a request generated, beside its record's timings."""

    text: str  # the generated text, all chunks joined
    token_ids: tuple[int, ...] | None  # the chunks' token_ids joined; None: the server sent none


@dataclass(slots=True)
class _Stream:
    """What one response has streamed so far (mutable while reading, then made a record)."""

    chunk_times: list[float]  # perf_counter() of each chunk that carries a token
    texts: list[str]  # the text of the chunks with text
    token_ids: list[int] | None = None  # the chunks' token_ids; None until a chunk has some
    usage: dict[str, Any] | None = None  # the last non-null ``usage`` seen
    done: bool = False  # ``data: [DONE]`` arrived
    error: str = ""  # why the stream failed


async def stream_request(
    client: httpx.AsyncClient,
    config: EndpointConfig,
    request: BenchRequest,
    count_tokens: Callable[[str], int],
    origin: float,
) -> RequestRecord:
    """Send ``request`` and time its stream; ``origin`` is the benchmark's perf_counter start."""
    record, _ = await stream_reply(client, config, request, count_tokens, origin)
    return record


async def stream_reply(
    client: httpx.AsyncClient,
    config: EndpointConfig,
    request: BenchRequest,
    count_tokens: Callable[[str], int],
    origin: float,
) -> tuple[RequestRecord, Reply]:
    """``stream_request``, and what the request generated."""
    state = _Stream([], [])
    start = time.perf_counter()
    try:
        async with client.stream(
            "POST", config.url, json=request_body(config, request), headers=config.headers()
        ) as response:
            if response.status_code != 200:
                state.error = _http_error(response.status_code, await response.aread())
            else:
                await _read_events(response, config.endpoint, state)
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        state.error = f"{type(error).__name__}: {error}"
    end = time.perf_counter()
    if not state.error and not state.done:
        state.error = "stream ended without data: [DONE]"
    record = _record(request, state, start - origin, end - start, start, count_tokens)
    token_ids = tuple(state.token_ids) if state.token_ids is not None else None
    return record, Reply("".join(state.texts), token_ids)


async def _read_events(response: httpx.Response, endpoint: Endpoint, state: _Stream) -> None:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, event: / id: fields
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            state.done = True
            return
        now = time.perf_counter()
        payload = json.loads(data)
        if payload.get("error"):
            state.error = f"error event: {_message(payload)}"
            return
        if payload.get("usage"):
            state.usage = payload["usage"]
        token_ids = chunk_token_ids(payload)
        if token_ids is not None:
            state.token_ids = state.token_ids or []
            state.token_ids.extend(token_ids)
        text = chunk_text(payload, endpoint)
        if text:
            state.texts.append(text)
        if carries_a_token(payload, endpoint):
            state.chunk_times.append(now)


def chunk_text(payload: dict[str, Any], endpoint: Endpoint) -> str:
    """The generated text in one stream chunk (all choices), "" for role / usage chunks."""
    parts = []
    for choice in payload.get("choices") or []:
        if endpoint == "chat":
            parts.append((choice.get("delta") or {}).get("content") or "")
        else:
            parts.append(choice.get("text") or "")
    return "".join(parts)


def carries_a_token(payload: dict[str, Any], endpoint: Endpoint) -> bool:
    """Whether a stream chunk is a token's arrival: it has a choice that is not chat's role
    chunk and does not say it has no token (``token_ids: []``)."""
    for choice in payload.get("choices") or []:
        if endpoint == "chat" and "role" in (choice.get("delta") or {}):
            continue
        if choice.get("token_ids") == []:
            continue
        return True
    return False


def chunk_token_ids(payload: dict[str, Any]) -> list[int] | None:
    """The output token ids in one stream chunk (all choices); None when it carries none."""
    found = [
        choice["token_ids"]
        for choice in payload.get("choices") or []
        if choice.get("token_ids") is not None
    ]
    return [int(t) for ids in found for t in ids] if found else None


def _record(
    request: BenchRequest,
    state: _Stream,
    send_time_s: float,
    e2e_s: float,
    start: float,
    count_tokens: Callable[[str], int],
) -> RequestRecord:
    times = state.chunk_times
    usage = state.usage or {}
    if usage.get("completion_tokens") is not None:
        output_tokens, source = int(usage["completion_tokens"]), "usage"
    else:
        output_tokens, source = count_tokens("".join(state.texts)), "tokenizer"
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return RequestRecord(
        index=request.index,
        prompt_len=int(usage.get("prompt_tokens") or request.prompt_len),
        output_len=request.output_len,
        success=not state.error,
        error=state.error,
        send_time_s=send_time_s,
        ttft_s=times[0] - start if times else None,
        e2e_s=e2e_s,
        itl_s=tuple(later - earlier for earlier, later in zip(times, times[1:])),
        output_tokens=output_tokens,
        output_tokens_source=source,
        conversation_id=request.conversation_id,
        turn_index=request.turn_index,
        cached_tokens=int(cached) if cached is not None else None,
    )


def _http_error(status: int, content: bytes) -> str:
    try:
        message = _message(json.loads(content))
    except (ValueError, AttributeError):
        message = content.decode(errors="replace")[:500]
    return f"HTTP {status}: {message}"


def _message(payload: Any) -> str:
    error = payload.get("error", payload) if isinstance(payload, dict) else payload
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)
