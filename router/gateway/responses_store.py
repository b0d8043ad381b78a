"""Responses kept by the gateway for ``previous_response_id`` and ``GET /v1/responses/{id}``,
with ``pdserve serve --responses-store-size N`` (vLLM keeps them with
``VLLM_ENABLE_RESPONSES_API_STORE``, in memory without bound; off by default in both).

The last N responses a request asked to store (``store``, OpenAI's default true) are kept in
this gateway's memory, least recently used first out, each under the API key that made it: a
key reads only its own (without keys, all are one owner). A kept response holds what a later
turn continues: the conversation so far as chat messages (earlier turns, this one's input,
this one's output as one assistant message; ``instructions`` are not carried over, as OpenAI
does not carry them) and the response as it was returned. Nothing survives a restart, and
several gateways do not share what they keep.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A kept response."""

    conversation: tuple[dict[str, Any], ...]  # chat messages: every turn up to its output
    body: dict[str, Any]  # the response as returned


def assistant_turn(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as the one assistant message a chat template takes: the
    message items' text as content, the function calls as tool_calls, the reasoning."""
    texts, calls, thoughts = [], [], []
    for item in output:
        if item["type"] == "message":
            texts += [part["text"] for part in item["content"]]
        elif item["type"] == "function_call":
            function = {"name": item["name"], "arguments": item["arguments"]}
            calls.append({"id": item["call_id"], "type": "function", "function": function})
        elif item["type"] == "reasoning":
            thoughts += [part["text"] for part in item["content"]]
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        turn["tool_calls"] = calls
    if thoughts:
        turn["reasoning"] = "\n".join(thoughts)
    return turn


class ResponseStore:
    """The last ``capacity`` stored responses (0: none kept), by owner and id."""

    def __init__(self, capacity: int = 0) -> None:
        if capacity < 0:
            raise ValueError(f"the responses store's size must be >= 0, got {capacity}")
        self.capacity = capacity
        self._kept: OrderedDict[tuple[str | None, str], StoredResponse] = OrderedDict()
        self._lock = threading.Lock()  # (requests are parsed on threads too)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def put(self, owner: str | None, response_id: str, stored: StoredResponse) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._kept[(owner, response_id)] = stored
            self._kept.move_to_end((owner, response_id))
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)

    def get(self, owner: str | None, response_id: str) -> StoredResponse | None:
        """Owner ``owner``'s response ``response_id``; None when it was never kept, has been
        let go, or is another owner's."""
        with self._lock:
            stored = self._kept.get((owner, response_id))
            if stored is not None:
                self._kept.move_to_end((owner, response_id))
            return stored

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)


@dataclass(frozen=True, slots=True)
class ResponsesTurn:
    """A /v1/responses request on its way: what its response continues, and where it is
    kept."""

    request: dict[str, Any]  # the request as sent
    conversation: tuple[dict[str, Any], ...]  # earlier turns and this input, as chat messages
    owner: str | None  # its API key's (``Caller.tenant_salt``)
    store: ResponseStore

    @property
    def kept(self) -> bool:
        """Whether its response is kept: the store keeps any and the request did not say
        ``store: false``."""
        return self.store.enabled and self.request.get("store") is not False

    def keep(self, body: dict[str, Any]) -> None:
        """Keeps the response ``body`` (when ``kept``)."""
        if self.kept:
            turns = (*self.conversation, assistant_turn(body["output"]))
            self.store.put(self.owner, body["id"], StoredResponse(turns, body))
