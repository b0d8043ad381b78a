"""Tool calls read from a chat's free text in MiniMax-M2's XML format, as vLLM's ``minimax_m2``
tool-call parser reads them: for ``tool_choice: "auto"``.

The model writes its calls in ``<minimax:tool_call>`` blocks, each call as ``<invoke
name="NAME">``, one ``<parameter name="KEY">value</parameter>`` per argument, and
``</invoke>``. Names are read without their quotes; a value is stripped and typed by the
request's tool schema as vLLM's parser types it (``minimax_value``).

- A whole text: content is the text before the first block (as written; None when there is
  none); each invoke one call, ``arguments`` ``json.dumps`` of its parameters (one written
  twice keeps the later value). A parameter cut by ``</invoke>``, the block's end or the end of
  the text is dropped; a first invoke whose name never ended (the text cut inside it) makes the
  whole text plain content with no calls, so nothing generated is lost (a later one is
  dropped); an invoke cut after its name is kept with the parameters that ended. Text between
  invokes, between blocks and after them is dropped.
- A stream: content deltas until the first block (text that may be the start of its tag held
  back until the next text shows whether it is); then each call's header (index, id, type,
  name) with ``{`` once its name ended, each parameter as ``"KEY": value`` (after the first,
  with ``, `` before it) once it ended, and ``}`` at ``</invoke>``: together the whole
  response's ``arguments``. A call cut by the end of the sample sends no ``}``; the
  finish_reason says ``length``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from router.gateway.qwen3_coder_tool_calls import ToolParameters
from router.gateway.tagged_calls import ReadCall, TaggedCallStream

START = "<minimax:tool_call>"
END = "</minimax:tool_call>"
INVOKE = "<invoke name="
INVOKE_END = "</invoke>"
PARAMETER = "<parameter name="
PARAMETER_END = "</parameter>"
_NAME_END = ">"

_Part = Literal["content", "between", "block", "name", "invoke", "key", "value"]
_NULLS = ("null", "none", "nil")
# the types tried in turn, the first the schema names that reads the value winning
_TYPE_ORDER = (
    "integer", "int", "number", "float", "boolean", "bool", "object", "array", "string", "str",
    "text",
)  # fmt: skip


def minimax_value(text: str, schema: Any) -> Any:
    """An argument's written value (stripped) as vLLM's minimax_m2 parser reads it (``schema``:
    the parameter's schema in the request's tools, None when they do not name it): ``null``,
    ``none`` or ``nil`` (any case) is null; otherwise the first of the schema's types (its
    ``type``, its ``enum`` values', those of its ``anyOf`` / ``oneOf`` / ``allOf``; a string when
    it names none) that reads the text, in the order integer, number, boolean (``true`` / ``1``
    / ``yes`` / ``on`` and their opposites), object or array (JSON), string; a text none reads is
    read as JSON, else kept."""
    if text.lower() in _NULLS:
        return None
    types = _schema_types(schema)
    for kind in _TYPE_ORDER:
        if kind not in types:
            continue
        if kind in ("string", "str", "text"):
            return text
        read = _read_as(kind, text)
        if read is not _UNREAD:
            return read
    read = _json(text)
    return text if read is _UNREAD else read


_UNREAD = object()  # a text the type does not read


def _read_as(kind: str, text: str) -> Any:
    if kind in ("integer", "int"):
        try:
            return int(text)
        except ValueError:
            return _UNREAD
    if kind in ("number", "float"):
        try:
            number = float(text)
        except ValueError:
            return _UNREAD
        if not math.isfinite(number):
            return _UNREAD  # JSON has no infinities
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool"):
        lowered = text.lower().strip()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        return _UNREAD
    return _json(text)  # object, array


def _json(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return _UNREAD


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _schema_types(schema: Any) -> set[str]:
    """The types a parameter's schema allows (lowercase); {"string"} when it names none."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    kind = schema.get("type")
    for name in [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []:
        if isinstance(name, str):
            types.add(name.lower())
    enum = schema.get("enum")
    for value in enum if isinstance(enum, list) else []:
        types.add(_type_of(value))
    for key in ("anyOf", "oneOf", "allOf"):
        choices = schema.get(key)
        for choice in choices if isinstance(choices, list) else []:
            types |= _schema_types(choice) if isinstance(choice, dict) else set()
    return types or {"string"}


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, list):
        return "array"
    return "object" if isinstance(value, dict) else "string"


def _unquoted(name: str) -> str:
    name = name.strip()
    if len(name) >= 2 and name[0] == name[-1] and name[0] in "\"'":
        return name[1:-1]
    return name


@dataclass(slots=True)
class _Reader:
    """The text after the content read call by call: ``feed`` pieces of it, cut at its tags."""

    parameters: ToolParameters  # the request's tools' parameter schemas
    calls: list[ReadCall] = field(default_factory=list)
    part: _Part = "content"
    buffer: str = ""  # the name, key or value being read
    key: str = ""  # the parameter whose value is being read
    unnamed: bool = False  # a first call's name never ended (whole: no calls)

    def tags(self) -> tuple[str, ...]:
        """The tags that end the part being read."""
        if self.part in ("content", "between"):
            return (START,)
        if self.part == "block":
            return (INVOKE, END)
        if self.part in ("name", "key"):
            return (_NAME_END, END)
        if self.part == "invoke":
            return (PARAMETER, INVOKE_END, END)
        return (PARAMETER_END, INVOKE_END, END)

    def read(self, piece: str, tag: str | None) -> list[dict[str, Any]]:
        """The stream entries of ``piece`` (the text before ``tag``, or all there is when
        None), then of ``tag``; content is the caller's (``part == "content"``)."""
        if self.part in ("name", "key", "value"):
            self.buffer += piece
        if tag is None:
            return []
        if tag == START:
            self.part = "block"
        elif tag == END:  # the block ends, an invoke open in it with it
            entries = self._close() if self.part not in ("block", "name") else []
            self.part, self.buffer = "between", ""
            return entries
        elif tag == INVOKE:
            self.part, self.buffer = "name", ""
        elif tag == PARAMETER:
            self.part, self.buffer = "key", ""
        elif tag == PARAMETER_END:
            self.part = "invoke"
            return self._end_value()
        elif tag == INVOKE_END:  # (a parameter open in it dropped)
            return self._close()
        elif self.part == "name":  # the name's ">"
            call = ReadCall(len(self.calls), _unquoted(self.buffer))
            self.calls.append(call)
            self.part, self.buffer = "invoke", ""
            return [call.header()]
        else:  # a parameter's name's ">"
            self.key, self.part, self.buffer = _unquoted(self.buffer), "value", ""
        return []

    def finish(self) -> None:
        """The text ended: a first call's name being read never ended."""
        if self.part == "name" and not self.calls:
            self.unnamed = True

    @property
    def in_call(self) -> bool:
        return self.part in ("name", "invoke", "key", "value")

    def _end_value(self) -> list[dict[str, Any]]:
        call = self.calls[-1]
        schema = self.parameters.get(call.name, {}).get(self.key)
        typed = minimax_value(self.buffer.strip(), schema)
        self.buffer = ""
        return [call.argument(self.key, typed)]

    def _close(self) -> list[dict[str, Any]]:
        self.part, self.buffer = "block", ""
        return [self.calls[-1].closing()]


def minimax_stream(parameters: ToolParameters) -> TaggedCallStream:
    """A reader of one choice's streamed text for MiniMax-M2's calls."""
    return TaggedCallStream(_Reader(parameters))


def parse_minimax(
    parameters: ToolParameters, text: str
) -> tuple[str | None, list[tuple[str, str]]]:
    """A whole text's content and its calls, (name, arguments JSON) each; (text, []) without
    calls, or when the first call's name is cut short."""
    return minimax_stream(parameters).parse(text)
