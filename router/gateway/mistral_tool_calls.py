"""Tool calls read from a chat's free text in the ``mistral`` format, as vLLM's ``mistral``
tool-call parser reads them: for ``tool_choice: "auto"``. Mistral's tokenizers make models write
calls in one of two forms after some content:

- before v11 (Mistral 7B v0.3, Mixtral 8x22B, Mistral Nemo ...): ``[TOOL_CALLS]`` and a JSON
  array of ``{"name": ..., "arguments": {...}}``;
- v11 and later (Mistral Small 3.1 and 3.2, Magistral, Devstral ...): each call as
  ``[TOOL_CALLS]name[ARGS]{...}``, its arguments a JSON object, one call after another; some
  write ``[CALL_ID]`` and an id of their own between the name and ``[ARGS]``.

vLLM picks the form by the tokenizer (``[ARGS]`` in its vocabulary: v11); here the text picks
it, to the same reading of what either kind of model writes: after the first ``[TOOL_CALLS]``, a
name (letters, digits, ``_``, ``-``, as Mistral's and OpenAI's function names) and ``[ARGS]`` or
``[CALL_ID]`` is v11, anything else the array. Either way each call gets a 9-character
alphanumeric id, as vLLM makes them (Mistral's templates check ids); a model's own
``[CALL_ID]`` id is dropped.

- A whole text: without ``[TOOL_CALLS]`` it is content. Else the content is the text before it
  (null when empty), and the calls are read from the text after it.

  The array, as vLLM's: the text after the tag, stripped, is read as JSON up to the end of its
  first value (text after that is dropped), or failing that, its first ``[{ ... }]`` span; each
  item is a call, ``arguments`` being ``json.dumps`` of its ``arguments`` (``{}`` without
  them). When neither parses, the content is the text after ``[TOOL_CALLS]``, stripped (vLLM's),
  with no calls. A second ``[TOOL_CALLS]``, or an array that is not of objects with a string
  ``name``, vLLM fails the request on; here the whole text is content.

  v11: each call's name is the text before its ``[ARGS]`` (up to ``[CALL_ID]``, spaces
  stripped), its ``arguments`` the JSON object after it, as written (vLLM's); text after the
  object up to the next ``[TOOL_CALLS]`` (or the end) is dropped, and tags inside the object's
  strings are data. A call without ``[ARGS]``, without a name, or whose arguments are not a
  JSON object makes the whole text content with no calls (vLLM returns such calls as they are).
- A stream: content until ``[TOOL_CALLS]`` starts (text that may be the start of the tag is
  held back until the next text shows whether it is, released at the end if it never is); the
  text after it is held until it shows which form it is, as the whole response reads it. The
  array is scanned as it arrives (``call_scanner``): a call's header (index, id, type, name)
  once its name's string closed, then its ``arguments`` value's text as written, in argument
  deltas (the whole response's ``json.dumps`` when the model spaces JSON as ``json.dumps``
  does; a call without ``arguments`` streams none); text after the array is dropped. v11
  calls: a call's header once its ``[ARGS]`` came, then its arguments object's text as written
  (the whole response's), to the brace that closes it; a call without a name takes no index
  and sends nothing. A stream cannot take back the calls it sent before a malformed one.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Callable
from typing import Any, Literal

from router.gateway.call_scanner import CallScanner, merged_entries
from router.gateway.tag_scan import TagCutter

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"  # v11+: between a call's name and its arguments
CALL_ID = "[CALL_ID]"  # some v11+ models: after a call's name, before its own id and [ARGS]
_ARRAY_SPAN = re.compile(r"\[{.*}\]", re.DOTALL)
_NAME = re.compile(r"[A-Za-z0-9_-]+")
# the text after the first [TOOL_CALLS] when it holds v11 calls: a name, then [ARGS] or [CALL_ID]
_V11_START = re.compile(r"\s*[A-Za-z0-9_-]+\s*\[(?:ARGS|CALL_ID)\]")
_NAMED = re.compile(r"\s*[A-Za-z0-9_-]+\s*")  # spaces, a name and spaces
_DECODER = json.JSONDecoder()
_ID_CHARACTERS = string.ascii_letters + string.digits


def new_mistral_tool_call_id() -> str:
    """A tool call's id as vLLM makes Mistral's: 9 alphanumeric characters."""
    return "".join(random.choices(_ID_CHARACTERS, k=9))


def parse_mistral(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """A whole text's content and its calls, (name, arguments JSON) each; content alone when
    the calls do not parse."""
    if TOOL_CALLS not in text:
        return text, []
    content, calls_text = text.split(TOOL_CALLS, 1)
    if not _V11_START.match(calls_text):
        return _parse_array(text)
    calls = _v11_calls(calls_text)
    if calls is None:
        return text, []
    return content or None, calls


def _parse_array(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """``parse_mistral`` of a text whose calls are an array (or are not v11's)."""
    content, *raw_calls = text.split(TOOL_CALLS)
    if len(raw_calls) != 1:
        return text, []
    stringified = raw_calls[0].strip()
    try:
        items, _ = _DECODER.raw_decode(stringified)
    except (ValueError, RecursionError):
        span = _ARRAY_SPAN.search(stringified)
        try:
            items = json.loads(span.group(0)) if span is not None else None
        except (ValueError, RecursionError):
            items = None
        if items is None:
            return stringified, []
    calls = _array_calls(items)
    if calls is None:
        return text, []
    return content or None, calls


def _array_calls(items: Any) -> list[tuple[str, str]] | None:
    if not isinstance(items, list):
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = json.dumps(item.get("arguments", {}), ensure_ascii=False)
        calls.append((item["name"], arguments))
    return calls


def _v11_calls(text: str) -> list[tuple[str, str]] | None:
    """The v11 calls of ``text``, what follows the first [TOOL_CALLS]: (name, arguments as
    written) each; None when one is malformed."""
    calls = []
    at = 0  # where the next call's name starts
    while True:
        args_at = text.find(ARGS, at)
        if args_at < 0 or TOOL_CALLS in text[at:args_at]:
            return None
        name = _v11_name(text[at:args_at])
        after_tag = text[args_at + len(ARGS) :]
        start = len(text) - len(after_tag.lstrip())
        try:
            arguments, end = _DECODER.raw_decode(text, start)
        except (ValueError, RecursionError):
            return None
        if name is None or not isinstance(arguments, dict):
            return None
        calls.append((name, text[start:end]))
        at = text.find(TOOL_CALLS, end)
        if at < 0:
            return calls
        at += len(TOOL_CALLS)


def _v11_name(head: str) -> str | None:
    """A v11 call's name, from the text between its [TOOL_CALLS] and [ARGS] (a [CALL_ID] and the
    model's id dropped); None when it is not a name."""
    name = head.split(CALL_ID, 1)[0].strip()
    return name if _NAME.fullmatch(name) else None


class MistralCallStream:
    """One choice's streamed text read for mistral tool calls: ``feed`` each text delta, then
    ``end`` once the sample ended."""

    def __init__(self) -> None:
        self.num_calls = 0  # calls whose header was sent
        self._tagged = False  # [TOOL_CALLS] came: the rest is calls
        # how the calls are read, once the text after the tag shows which form it is
        self._reader: CallScanner | V11CallReader | None = None
        self._undecided = ""  # the text after the tag until then
        self._cutter = TagCutter(lambda: () if self._tagged else (TOOL_CALLS,))

    @property
    def block_open(self) -> bool:
        """Whether the text ends inside the array of calls, or inside a v11 call."""
        if isinstance(self._reader, CallScanner):
            return self._reader.depth > 0
        return self._reader is not None and self._reader.block_open

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content and the tool_calls entries of a delta of ``text``."""
        content: list[str] = []
        entries: list[dict[str, Any]] = []
        for piece, tag in self._cutter.feed(text):
            if self._tagged:
                entries += self._calls(piece)
            else:
                content.append(piece)
            if tag == TOOL_CALLS:
                self._tagged = True
        return "".join(content), entries

    def end(self) -> tuple[str, list[dict[str, Any]]]:
        """The content still held back once the sample ended: a partial tag that never
        completed."""
        return self._cutter.end(), []

    def _calls(self, text: str) -> list[dict[str, Any]]:
        if self._reader is None:
            text = self._undecided = self._undecided + text
            if _V11_START.match(text):
                self._reader = V11CallReader(new_mistral_tool_call_id)
            elif _may_start_v11(text):
                return []
            else:
                self._reader = CallScanner(
                    arguments_keys=("arguments",), new_call_id=new_mistral_tool_call_id
                )
            self._undecided = ""
        entries = self._reader.feed(text)
        self.num_calls = self._reader.num_headers
        return entries


def _may_start_v11(text: str) -> bool:
    """Whether more text may make ``text`` (after the first [TOOL_CALLS]) the start of v11
    calls: spaces, a name, then at most the start of [ARGS] or [CALL_ID]."""
    named = _NAMED.match(text)
    if named is None:
        return not text.strip()
    rest = text[named.end() :]
    return ARGS.startswith(rest) or CALL_ID.startswith(rest)


class V11CallReader:
    """Streamed v11 calls, the text after the first ``[TOOL_CALLS]``: ``name[ARGS]{...}``, then
    any more after a ``[TOOL_CALLS]`` each. A call's header once its ``[ARGS]`` came, then its
    arguments object's text, first brace to last, as argument deltas; text after the object up
    to the next ``[TOOL_CALLS]`` is dropped."""

    def __init__(self, new_call_id: Callable[[], str]) -> None:
        self.new_call_id = new_call_id  # a new call's id, in the format's form
        self.num_headers = 0  # calls whose header was announced: the next one's index
        # "name": before a call's [ARGS] (its name, [CALL_ID] and id); "arguments": after it, to
        # the end of its object; "between": after that, to the next [TOOL_CALLS]
        self._phase: Literal["name", "arguments", "between"] = "name"
        self._held = ""  # the text of the phase, name or between, whose tag has not come
        self._call_index: int | None = None  # the call being read (None: no name, unsent)
        self._depth = 0  # containers open in the arguments (0: its "{" did not come)
        self._in_string = False
        self._escaped = False  # the string's last character was an unescaped backslash

    @property
    def block_open(self) -> bool:
        """Whether the text ends inside a call, before its arguments object closed."""
        return self._phase != "between"

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The tool_calls entries of a delta of ``text``."""
        events: list[tuple[int, str | None, str]] = []  # (call, name announced, arguments)
        while text:
            if self._phase == "arguments":
                text = self._arguments(text, events)
            else:
                text = self._until_tag(text, events)
        return merged_entries(events, self.new_call_id)

    def _until_tag(self, text: str, events: list[tuple[int, str | None, str]]) -> str:
        """Holds a name, or drops the text between calls, until the phase's tag: what follows
        the tag ("" until it came)."""
        tags = (ARGS, TOOL_CALLS) if self._phase == "name" else (TOOL_CALLS,)
        from_at = max(0, len(self._held) - len(TOOL_CALLS) + 1)  # where a new tag can start
        held = self._held + text
        found = [(at, tag) for tag in tags if (at := held.find(tag, from_at)) >= 0]
        if not found:
            # between calls only the end that may start a tag is kept
            self._held = held if self._phase == "name" else held[-len(TOOL_CALLS) + 1 :]
            return ""
        at, tag = min(found)
        self._held = ""
        if tag == ARGS:
            self._start_call(held[:at], events)
        else:
            self._phase = "name"
        return held[at + len(tag) :]

    def _start_call(self, head: str, events: list[tuple[int, str | None, str]]) -> None:
        """Announces the call whose name ``head`` holds (none when it is not a name)."""
        name = _v11_name(head)
        self._call_index = None
        if name is not None:
            self._call_index = self.num_headers
            self.num_headers += 1
            events.append((self._call_index, name, ""))
        self._phase = "arguments"
        self._depth, self._in_string, self._escaped = 0, False, False

    def _arguments(self, text: str, events: list[tuple[int, str | None, str]]) -> str:
        """Scans the arguments object's text, as JSON: what follows its end ("" when it goes
        on)."""
        sent: list[str] = []
        rest = ""
        for at, char in enumerate(text):
            if self._depth == 0:  # before the object
                if char.isspace():
                    continue
                if char != "{":  # not an object: the call ends here
                    self._phase, rest = "between", text[at:]
                    break
            self._json_char(char)
            sent.append(char)
            if self._depth == 0:  # the object closed
                self._phase, rest = "between", text[at + 1 :]
                break
        if sent and self._call_index is not None:
            events.append((self._call_index, None, "".join(sent)))
        return rest

    def _json_char(self, char: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
