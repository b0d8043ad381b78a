"""What ``/v1/responses`` returns (OpenAI's Responses API, as vLLM serves it), made from the
chat path's response or stream (``responses_request`` reads the request as a chat request).

A response is ``{"id": "resp_...", "object": "response", "status", "output": [items], "usage",
...}`` with the request's settings echoed. Its output items, in the order the model wrote them:
a ``reasoning`` item (the thought, under a reasoning parser: ``content`` one ``reasoning_text``
part), a ``message`` item (the content, one ``output_text`` part), and a ``function_call``
item per tool call (``call_id``, ``name``, ``arguments``). ``status``: ``completed``, or
``incomplete`` with ``incomplete_details.reason: "max_output_tokens"`` when ``max_output_tokens``
cut it, ``cancelled`` when an Abort ended it. Asked for (``include``), the ``output_text``
part's ``logprobs`` are chat's entries (``token``, ``logprob``, ``bytes``, ``top_logprobs``)
of every output token, as vLLM's; a stream's ``output_text.delta`` carries those of its text,
and the done events all the message's, those of its chunks without text (the eos token's)
included; those of chunks of reasoning alone are not sent, as in vLLM's stream. ``usage``:
``input_tokens`` (with ``input_tokens_details.cached_tokens``), ``output_tokens`` (with
``output_tokens_details.reasoning_tokens``) and ``total_tokens``.

A stream is OpenAI's server-sent events, each ``event: TYPE`` with its JSON: ``response.created``
and ``response.in_progress`` first; per item ``response.output_item.added``, its deltas
(``response.reasoning_text.delta``, ``response.output_text.delta`` within a
``response.content_part.added`` / ``.done`` pair, ``response.function_call_arguments.delta``),
their ``.done`` events and ``response.output_item.done``; then ``response.completed`` (or
``response.incomplete``) with the whole response. Every event has a ``sequence_number``. An
error after the 200 is an ``error`` event.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from router.gateway.errors import ApiError
from router.gateway.responses_store import ResponsesTurn


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_body(response_id: str, turn: ResponsesTurn, chat: Mapping[str, Any]) -> dict[str, Any]:
    """The whole response for the Responses request ``turn`` from the chat path's response,
    kept when the turn asks (``ResponsesTurn.keep``)."""
    (choice,) = chat["choices"]
    message = choice["message"]
    items = []
    if message.get("reasoning"):
        items.append(_reasoning_item(message["reasoning"]))
    if message.get("content"):
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        status = _item_status(choice["finish_reason"])
        items.append(_message_item(message["content"], status, logprobs=logprobs))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        items.append(_call_item(call["id"], function["name"], function["arguments"]))
    created_at = chat.get("created", int(time.time()))
    return finished(response_id, turn, created_at, choice["finish_reason"], items, chat["usage"])


def finished(
    response_id: str,
    turn: ResponsesTurn,
    created_at: int,
    finish_reason: str | None,
    items: list[dict[str, Any]],
    chat_usage: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The finished response of ``items`` (kept when the turn asks): whole, or a stream's
    last event's."""
    body = envelope(response_id, turn, created_at)
    body.update(_ending(finish_reason))
    body["output"] = items
    body["usage"] = _usage(chat_usage) if chat_usage else None
    turn.keep(body)
    return body


def envelope(response_id: str, turn: ResponsesTurn, created_at: int) -> dict[str, Any]:
    """A response's fields but its output and usage: the request's settings, in progress."""
    request = turn.request
    effort = (request.get("reasoning") or {}).get("effort")
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "model": request.get("model"),
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "metadata": request.get("metadata"),
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "previous_response_id": request.get("previous_response_id"),
        "reasoning": {"effort": effort, "summary": None},
        "store": turn.kept,
        "background": False,
        "temperature": request.get("temperature"),
        "top_p": request.get("top_p"),
        "text": request.get("text") or {"format": {"type": "text"}},
        "tool_choice": request.get("tool_choice", "auto"),
        "tools": request.get("tools") or [],
        "truncation": "disabled",
        "user": request.get("user"),
        "output": [],
        "usage": None,
    }


def _ending(finish_reason: str | None) -> dict[str, Any]:
    if finish_reason == "length":
        return {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
    if finish_reason == "abort":
        return {"status": "cancelled"}
    return {"status": "completed"}


def _item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "id": item_id or new_item_id("rs"),
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message_item(
    text: str,
    status: str,
    item_id: str | None = None,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "id": item_id or new_item_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [_text_part(text, logprobs)] if text or status != "in_progress" else [],
    }


def _call_item(
    call_id: str, name: str, arguments: str, status: str = "completed", item_id: str | None = None
) -> dict[str, Any]:
    return {
        "id": item_id or new_item_id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _usage(chat_usage: Mapping[str, Any]) -> dict[str, Any]:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached or 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning or 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def sse_event(event: dict[str, Any]) -> bytes:
    """One server-sent event as OpenAI streams a response's: its type, then its JSON."""
    payload = json.dumps(event, ensure_ascii=False)
    return f"event: {event['type']}\ndata: {payload}\n\n".encode()


@dataclass(slots=True)
class _OpenItem:
    """The output item being streamed."""

    kind: str  # "reasoning", "message" or "function_call"
    item_id: str
    output_index: int
    text: str = ""  # its text or arguments so far
    call_id: str = ""  # a function call's
    name: str = ""  # a function call's
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # a message's, when asked for


@dataclass(slots=True)
class ResponseEvents:
    """A chat stream's chunks (one choice, usage last) as a response's events: ``start``, then
    ``chunk`` for each chunk, then ``end``; ``error`` for a failure after the 200."""

    response_id: str
    turn: ResponsesTurn  # the request, and where its response is kept
    created_at: int = field(default_factory=lambda: int(time.time()))
    _sequence: int = 0
    _open: _OpenItem | None = None
    _items: list[dict[str, Any]] = field(default_factory=list)  # the finished ones
    _calls: dict[int, _OpenItem] = field(default_factory=dict)  # by their chat index
    _finish_reason: str | None = None
    _usage: dict[str, Any] | None = None  # the chat stream's usage chunk's

    def start(self) -> list[bytes]:
        head = envelope(self.response_id, self.turn, self.created_at)
        return [
            self._event("response.created", response=head),
            self._event("response.in_progress", response=head),
        ]

    def chunk(self, chunk: Mapping[str, Any]) -> list[bytes]:
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        events: list[bytes] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                events += self._text("reasoning", delta["reasoning"])
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            if delta.get("content"):
                events += self._text("message", delta["content"], logprobs)
            elif self._open is not None and self._open.kind == "message":
                self._open.logprobs += logprobs  # (a chunk of no text: the end's eos token)
            for entry in delta.get("tool_calls") or []:
                events += self._call(entry)
            if choice.get("finish_reason") is not None:
                self._finish_reason = choice["finish_reason"]
        return events

    def end(self) -> list[bytes]:
        events = self._close()
        body = finished(
            self.response_id,
            self.turn,
            self.created_at,
            self._finish_reason,
            self._items,
            self._usage,
        )
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=body)]

    def error(self, error: ApiError) -> bytes:
        return self._event("error", code=error.code, message=error.message, param=error.param)

    def done(self) -> list[bytes]:
        return []  # (no [DONE]: a response's stream ends with its last event)

    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse_event(event)

    def _opened(
        self, kind: str, item: dict[str, Any], call_id: str = "", name: str = ""
    ) -> list[bytes]:
        events = self._close()
        self._open = _OpenItem(kind, item["id"], len(self._items), call_id=call_id, name=name)
        events.append(
            self._event("response.output_item.added", output_index=len(self._items), item=item)
        )
        if kind == "message":
            events.append(self._part_event("response.content_part.added", _text_part("")))
        return events

    def _text(
        self, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None
    ) -> list[bytes]:
        events: list[bytes] = []
        if self._open is None or self._open.kind != kind:
            item_id = new_item_id("rs" if kind == "reasoning" else "msg")
            item = (
                {"id": item_id, "type": "reasoning", "summary": [], "content": []}
                if kind == "reasoning"
                else _message_item("", "in_progress", item_id)
            )
            events = self._opened(kind, item)
        assert self._open is not None
        self._open.text += text
        self._open.logprobs += logprobs or []
        name = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": logprobs or []}
        events.append(self._at_open(name, content_index=0, delta=text, **extra))
        return events

    def _call(self, entry: Mapping[str, Any]) -> list[bytes]:
        function = entry.get("function") or {}
        events: list[bytes] = []
        if "id" in entry:  # a call's header
            item_id = new_item_id("fc")
            item = _call_item(entry["id"], function["name"], "", "in_progress", item_id)
            events = self._opened("function_call", item, call_id=entry["id"], name=function["name"])
            assert self._open is not None
            self._calls[entry["index"]] = self._open
        arguments = function.get("arguments") or ""
        if arguments:
            call = self._calls[entry["index"]]
            call.text += arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=call.item_id,
                    output_index=call.output_index,
                    delta=arguments,
                )
            )
        return events

    def _close(self) -> list[bytes]:
        """The open item's closing events (none when no item is open)."""
        item = self._open
        if item is None:
            return []
        if item.kind == "reasoning":
            events = [
                self._at_open("response.reasoning_text.done", content_index=0, text=item.text)
            ]
            done = _reasoning_item(item.text, item.item_id)
        elif item.kind == "message":
            status = _item_status(self._finish_reason)
            part = _text_part(item.text, item.logprobs)
            events = [
                self._at_open(
                    "response.output_text.done",
                    content_index=0,
                    text=item.text,
                    logprobs=item.logprobs,
                ),
                self._part_event("response.content_part.done", part),
            ]
            done = _message_item(item.text, status, item.item_id, item.logprobs)
        else:
            events = [
                self._at_open(
                    "response.function_call_arguments.done", name=item.name, arguments=item.text
                )
            ]
            done = _call_item(item.call_id, item.name, item.text, "completed", item.item_id)
        self._open = None
        events.append(
            self._event("response.output_item.done", output_index=item.output_index, item=done)
        )
        self._items.append(done)
        return events

    def _at_open(self, kind: str, **fields: Any) -> bytes:
        assert self._open is not None
        return self._event(
            kind, item_id=self._open.item_id, output_index=self._open.output_index, **fields
        )

    def _part_event(self, kind: str, part: dict[str, Any]) -> bytes:
        return self._at_open(kind, content_index=0, part=part)
