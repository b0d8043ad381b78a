"""Streamed JSON call objects (``{"name": ..., <arguments key>: ...}``) read as they arrive, as
tool_calls stream entries: a call's header (its index, id, type and name) once its name's
string closed, then the text of its arguments value, first character to last, as argument
deltas. Calls are numbered as their headers are announced, 0, 1, 2 ...: a call object whose
name never comes (none, or not a string) takes no index and sends nothing. The "required" array
(``tool_calls``), hermes ``<tool_call>`` blocks (``hermes_tool_calls``), llama3_json objects
(``llama_tool_calls``) and mistral's ``[TOOL_CALLS]`` array (``mistral_tool_calls``) stream
through it; mistral's v11 calls (``[TOOL_CALLS]name[ARGS]{...}``) send their entries through
``merged_entries``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def new_tool_call_id() -> str:
    """A tool call's id, as vLLM makes one."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def call_entry(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    """A whole response's tool call of ``name`` with ``arguments`` (JSON text); ``call_id``:
    its id (None: a new ``chatcmpl-tool-`` one)."""
    return {
        "id": call_id or new_tool_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def header_entry(
    call_index: int, name: str, arguments: str, call_id: str | None = None
) -> dict[str, Any]:
    """A streamed call's first entry: its index, id (None: a new ``chatcmpl-tool-`` one), type
    and name, with its first text."""
    return {"index": call_index, **call_entry(name, arguments, call_id)}


@dataclass(slots=True)
class _Call:
    """A call object being scanned."""

    index: int | None = None  # its tool_calls index, once its name's string closed
    pending_arguments: str = ""  # argument text scanned before the name was (not sent yet)


@dataclass(slots=True)
class CallScanner:
    """Scans an array of call objects (``[{"name": ..., "parameters": ...}, ...]``, "required"'s
    output) character by character as it streams, as JSON: containers, strings and their
    escapes, and in each call object the key a value belongs to. The value of one of the
    ``arguments_keys``, its text first character to last, is the call's arguments; its name's
    string, once closed, announces the call (with the arguments scanned before it, when they
    came first) under the next index; a second name in the same object is not read."""

    # the call object's keys whose value is the arguments
    arguments_keys: tuple[str, ...] = ("parameters",)
    # True: between call objects any text but "{" is skipped (llama3_json's "; " separators and
    # whatever else the model writes there); False: JSON, an array's commas
    separated_by_text: bool = False
    new_call_id: Callable[[], str] = new_tool_call_id  # a new call's id, in the format's form
    # calls whose header was announced: the next one's index (a scanner that goes on with
    # another's numbering starts at that one's count)
    num_headers: int = 0
    _stack: list[str] = field(default_factory=list)  # open containers, "[" or "{"
    _in_string: bool = False
    _escaped: bool = False  # the string's last character was an unescaped backslash
    _key: str | None = None  # the call object's key whose value comes or is being scanned
    _after_colon: bool = False  # in a call object, between a key's colon and the next comma
    _key_text: str | None = None  # the JSON text of a call object's key, while it is open
    _name_text: str | None = None  # the JSON text of a call's name, while it is open
    # where the scan is in an arguments value: "before" (its colon passed, spaces may follow),
    # "container", "string", "scalar" (a number or literal, ended by what follows); None: not
    _value: str | None = None
    _calls: list[_Call] = field(default_factory=list)

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The tool_calls entries of a delta of ``text``."""
        events: list[tuple[int, str | None, str]] = []  # (call, name announced, arguments)
        for char in text:
            if self._value is None or not self._value_char(char, events):
                self._structure_char(char, events)
        return merged_entries(events, self.new_call_id)

    @property
    def depth(self) -> int:
        """How many containers are open (the array counts one, an open call object two)."""
        return len(self._stack)

    def _in_call(self) -> bool:
        return self._stack == ["[", "{"] and bool(self._calls)

    def _structure_char(self, char: str, events: list[tuple[int, str | None, str]]) -> None:
        """``char`` outside an arguments value."""
        if self.separated_by_text and self._stack == ["["] and char != "{":
            return
        if self._in_string:
            self._string_char(char, events)
        elif char == '"':
            self._in_string, self._escaped = True, False
            if self._in_call():
                if not self._after_colon:
                    self._key_text = char
                elif self._key == "name" and self._calls[-1].index is None:
                    self._name_text = char
        elif char in "[{":
            if self._stack == ["["] and char == "{":
                self._calls.append(_Call())
                self._key, self._after_colon = None, False
            self._stack.append(char)
        elif char in "]}":
            if self._stack:
                self._stack.pop()
        elif char == ":" and self._in_call():
            self._after_colon = True
            if self._key in self.arguments_keys:
                self._value = "before"
        elif char == "," and self._in_call():
            self._key, self._after_colon = None, False

    def _string_char(self, char: str, events: list[tuple[int, str | None, str]]) -> None:
        closing = char == '"' and not self._escaped
        self._escaped = char == "\\" and not self._escaped
        if self._key_text is not None:
            self._key_text += char
            if closing:
                self._key, self._key_text = _json_string(self._key_text), None
        elif self._name_text is not None:
            self._name_text += char
            if closing:
                call = self._calls[-1]
                call.index, name = self.num_headers, _json_string(self._name_text) or ""
                self._name_text = None
                events.append((call.index, name, call.pending_arguments))
                call.pending_arguments = ""
                self.num_headers += 1
        if closing:
            self._in_string = False

    def _value_char(self, char: str, events: list[tuple[int, str | None, str]]) -> bool:
        """Scans ``char`` as part of the arguments value (or spaces before it); False when the
        value ended before it, ``char`` being the call object's again."""
        if self._value == "before":
            if char.isspace():
                return True
            if char in ",}]":  # no value (not JSON the constraint admits)
                self._value = None
                return False
            self._value = {"{": "container", "[": "container", '"': "string"}.get(char, "scalar")
            if self._value == "container":
                self._stack.append(char)
            self._in_string = self._value == "string"
            self._escaped = False
        elif self._value == "scalar":
            if char in ",}]" or char.isspace():
                self._value = None
                return False
        elif self._in_string:
            closing = char == '"' and not self._escaped
            self._escaped = char == "\\" and not self._escaped
            if closing:
                self._in_string = False
                if self._value == "string":
                    self._value = None
        elif char == '"':
            self._in_string = True
        elif char in "[{":
            self._stack.append(char)
        elif char in "]}" and self._stack:
            self._stack.pop()
            if self._in_call():  # the value's container closed
                self._value = None
        self._argument(char, events)
        return True

    def _argument(self, text: str, events: list[tuple[int, str | None, str]]) -> None:
        call = self._calls[-1]
        if call.index is None:
            call.pending_arguments += text
        else:
            events.append((call.index, None, text))


def _json_string(text: str) -> str | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def merged_entries(
    events: list[tuple[int, str | None, str]], new_call_id: Callable[[], str]
) -> list[dict[str, Any]]:
    """Scan events, (call index, name announced or None, arguments text) each, as tool_calls
    entries: a header where a name was announced (with a new id), then the arguments of one
    call run together."""
    entries: list[dict[str, Any]] = []
    for call_index, name, arguments in events:
        if name is not None:
            entries.append(header_entry(call_index, name, arguments, new_call_id()))
        elif entries and entries[-1]["index"] == call_index:
            entries[-1]["function"]["arguments"] += arguments
        else:
            entries.append({"index": call_index, "function": {"arguments": arguments}})
    return entries
