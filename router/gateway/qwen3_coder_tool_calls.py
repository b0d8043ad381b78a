"""Tool calls read from a chat's free text in Qwen3-Coder's XML format, as vLLM's
``qwen3_coder`` (and ``qwen3_xml``) tool-call parsers read them: for ``tool_choice: "auto"``.

The model writes each call as ``<tool_call>`` then ``<function=NAME>``, one
``<parameter=KEY>`` newline, value, newline, ``</parameter>`` per argument, ``</function>`` and
``</tool_call>``. The values are bare text, typed by the request's tool schema
(``typed_value``): a parameter whose schema says integer is sent as a JSON number, a string as
a string, an object as the JSON the model wrote.

- A whole text: content is the text before the first ``<tool_call>`` or ``<function=`` (as
  written; None when there is none); each function one call, ``arguments`` being
  ``json.dumps`` of its parameters (a parameter written twice keeps the later value). A value
  runs from after its name's ``>`` (one newline dropped) to ``</parameter>``, the next
  ``<parameter=``, ``</function>`` or ``</tool_call>`` (one newline before it dropped), or the
  end of the text; a function runs to ``</function>`` or ``</tool_call>``, or the end. A
  function or parameter whose name's ``>`` never comes (the text cut inside it) makes the whole
  text plain content with no calls, so nothing generated is lost. Text between and after the
  calls is dropped, as vLLM drops it.
- A stream: content deltas until the calls start (text that may be the start of a tag held
  back until the next text shows whether it is); then each call's header (index, id, type,
  name) with ``{`` once its name is whole, each parameter as ``"KEY": value`` (after the first,
  with ``, `` before it) once its value ended, and ``}`` at the function's end: together the
  whole response's ``arguments`` (a parameter written twice is sent twice, and a JSON reader
  keeps the later, as the whole response does). A call cut by the end of the sample sends no
  part of its unfinished parameter and no ``}``; the finish_reason says ``length``. Calls that
  began but never had a name are sent as content at the end, as the whole response has them;
  a stream cannot take back a call it sent before one whose parameter's name is cut short.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from router.gateway.tagged_calls import ReadCall, TaggedCallStream

START = "<tool_call>"
END = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"
_NAME_END = ">"

# a function's name -> the schemas of its parameters by name (its ``parameters.properties``)
ToolParameters = Mapping[str, Mapping[str, Any]]

_STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})
_INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_Part = Literal["content", "between", "name", "function", "key", "value"]


def tool_parameters(tools: list[dict[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """Each checked tool's parameter schemas by name (``tool_fields``' tools)."""
    found: dict[str, Mapping[str, Any]] = {}
    for tool in tools:
        function = tool["function"]
        schema = function.get("parameters")
        properties = schema.get("properties") if isinstance(schema, dict) else None
        found[function["name"]] = properties if isinstance(properties, dict) else {}
    return found


def typed_value(text: str, schema: Any) -> Any:
    """A parameter's written value as its schema types it (``schema``: None when the tool does
    not name the parameter), as vLLM's qwen3_coder parser reads it: ``null`` is null whatever
    the type; a string type, or no schema, keeps the text; an integer or number type its number
    (a number with no fraction an integer); a boolean ``true`` (any case) true, anything else
    false; an object or array the JSON written; any other type a Python or JSON literal. A text
    that is not what the type asks is kept as text. A type listed with others (``["integer",
    "null"]``) is read as its first that is not ``null``."""
    if text.lower() == "null":
        return None
    if schema is None:
        return text
    kind = _type_name(schema)
    if kind in _STRING_TYPES:
        return text
    if kind.startswith(_INTEGER_PREFIXES):
        try:
            return int(text)
        except ValueError:
            return text
    if kind.startswith(("num", "float")):
        try:
            number = float(text)
        except ValueError:
            return text
        if not math.isfinite(number):
            return text  # JSON has no infinities
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return text.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            pass
    return literal_value(text)


def _type_name(schema: Any) -> str:
    kind = schema.get("type", "string") if isinstance(schema, dict) else "string"
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    return str(kind).strip().lower()


def literal_value(text: str) -> Any:
    """``text`` as a Python literal that JSON can write; the text itself otherwise."""
    try:
        value = ast.literal_eval(text)
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text
    return value


@dataclass(slots=True)
class _Reader:
    """The text after the content read call by call: ``feed`` pieces of it, cut at its tags."""

    parameters: ToolParameters  # the request's tools' parameter schemas
    calls: list[ReadCall] = field(default_factory=list)
    part: _Part = "content"
    buffer: str = ""  # the name or value being read
    key: str = ""  # the parameter whose value is being read
    unnamed: bool = False  # a function or parameter's name never closed (whole: no calls)

    def tags(self) -> tuple[str, ...]:
        """The tags that end the part being read."""
        if self.part == "content":
            return (START, FUNCTION)
        if self.part == "between":
            return (FUNCTION,)
        if self.part in ("name", "key"):
            return (_NAME_END, END)
        if self.part == "function":
            return (PARAMETER, FUNCTION_END, END)
        return (PARAMETER_END, PARAMETER, FUNCTION_END, END)

    def read(self, piece: str, tag: str | None) -> list[dict[str, Any]]:
        """The stream entries of ``piece`` (the text before ``tag``, or all there is when
        None), then of ``tag``; content is the caller's (``part == "content"``)."""
        if self.part in ("name", "key", "value"):
            self.buffer += piece
        if tag is None:
            return []
        if self.part in ("content", "between"):
            self.part, self.buffer = "name", ""  # (a <tool_call>, or <function= itself)
            if tag == START:
                self.part = "between"
            return []
        if self.part == "name":
            if tag == END:  # the block closed inside the name
                self.unnamed, self.part = True, "between"
                return []
            call = ReadCall(len(self.calls), self.buffer)
            self.calls.append(call)
            self.part = "function"
            return [call.header()]
        if self.part == "key":
            if tag == END:
                self.unnamed = True
                return self._close()
            self.key, self.buffer, self.part = self.buffer, "", "value"
            return []
        entries = self._end_value() if self.part == "value" else []
        if tag == PARAMETER:
            self.part, self.buffer = "key", ""
            return entries
        if tag == PARAMETER_END:
            self.part = "function"
            return entries
        return entries + self._close()  # </function> or </tool_call>

    def finish(self) -> None:
        """The text ended: the value being read ends there, and its call (a whole text's)."""
        if self.part == "value":
            self._end_value()
        elif self.part in ("name", "key"):
            self.unnamed = True
        if self.part in ("function", "value", "key"):
            self._close()

    @property
    def in_call(self) -> bool:
        return self.part in ("name", "function", "key", "value")

    def _end_value(self) -> list[dict[str, Any]]:
        call = self.calls[-1]
        value = self.buffer.removeprefix("\n").removesuffix("\n")
        self.buffer = ""
        schemas = self.parameters.get(call.name, {})
        return [call.argument(self.key, typed_value(value, schemas.get(self.key)))]

    def _close(self) -> list[dict[str, Any]]:
        self.part = "between"
        return [self.calls[-1].closing()]


def qwen3_coder_stream(parameters: ToolParameters) -> TaggedCallStream:
    """A reader of one choice's streamed text for Qwen3-Coder's calls."""
    return TaggedCallStream(_Reader(parameters))


def parse_qwen3_coder(
    parameters: ToolParameters, text: str
) -> tuple[str | None, list[tuple[str, str]]]:
    """A whole text's content and its calls, (name, arguments JSON) each; (text, []) without
    calls, or when a function's or parameter's name is cut short."""
    return qwen3_coder_stream(parameters).parse(text)
