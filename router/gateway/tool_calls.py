"""Chat output returned as tool calls, whole or streamed, as vLLM shapes them.

A named ``tool_choice`` (constrained output): the output is the function's arguments, so the
message is one call of it, ``{"id": "chatcmpl-tool-<hex>", "type": "function", "function":
{"name", "arguments": <the text>}}``, with ``content: ""``; a stream sends the call's id, type
and name with its first text, then each text delta as ``{"index": 0, "function":
{"arguments": <delta>}}``.

``"required"`` (constrained output): the output is a JSON array of ``{"name", "parameters"}``;
the message has one call per item, ``arguments`` being ``json.dumps`` of its parameters. Text
that does not parse (cut by ``max_tokens``) is returned as ``content`` with no calls, so nothing
generated is lost (vLLM returns it empty). A stream scans the array as it arrives
(``call_scanner``): a call's header (index, id, type, name) once its name is whole, then its
parameters' text as argument deltas.

``"auto"`` (free output, with ``--enable-auto-tool-choice --tool-call-parser NAME``): the
parser reads the calls from the text (``hermes_tool_calls``, ``llama_tool_calls`` for
``llama3_json`` and ``llama4_json``, ``mistral_tool_calls``, ``deepseek_tool_calls`` for
``deepseek_v3`` and ``deepseek_v31``, ``kimi_tool_calls`` for ``kimi_k2`` (its calls' ids
kept), ``pythonic_tool_calls`` for ``pythonic`` and ``llama4_pythonic``,
``qwen3_coder_tool_calls`` for ``qwen3_coder`` and ``qwen3_xml``, ``glm_tool_calls`` for
``glm45`` and ``glm47`` and ``minimax_tool_calls`` for ``minimax_m2``, whose values are typed by
the request's tool schemas); the message has the content the parser leaves (null when there is
none) and the calls, or the text as content and ``tool_calls: []``.

finish_reason, constrained: a whole response keeps the sample's (``stop`` / ``length``), as vLLM
does (and OpenAI for a forced function); a stream says ``tool_calls`` where the sample stopped
after streaming a call, as vLLM's stream does (``length`` stays ``length``: the arguments were
cut). ``"auto"``: ``tool_calls`` when the text held calls, as vLLM's whole response says it; a
stream says so when it sent a call; both say ``length`` where ``length`` cut a call short (the
text ended inside one; vLLM's whole response would say ``tool_calls`` for one its parser still
reads).

Under ``--reasoning-parser`` the reasoning is split off first (``reasoning``), into the
message's ``reasoning`` (a stream's ``reasoning`` deltas), and only the rest is read for calls,
as vLLM reads them from the content alone. gpt-oss's harmony reply (``openai_gptoss``) is read
message by message instead (``harmony``): its calls are messages of their own, returned with
``--tool-call-parser openai`` ("auto"); a forced call is read from its final answer's text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from router.gateway.call_scanner import CallScanner, call_entry, header_entry, new_tool_call_id
from router.gateway.deepseek_tool_calls import DeepSeekCallStream, parse_deepseek
from router.gateway.glm_tool_calls import glm_stream, parse_glm
from router.gateway.harmony import (
    HARMONY_TOOL_CALL_PARSER,
    CallPiece,
    HarmonyStream,
    read_harmony,
)
from router.gateway.hermes_tool_calls import HermesCallStream, parse_hermes
from router.gateway.kimi_tool_calls import KimiCallStream, kimi_call_ids, parse_kimi
from router.gateway.llama_tool_calls import Llama3JsonCallStream, parse_llama3_json
from router.gateway.minimax_tool_calls import minimax_stream, parse_minimax
from router.gateway.mistral_tool_calls import (
    MistralCallStream,
    new_mistral_tool_call_id,
    parse_mistral,
)
from router.gateway.pythonic_tool_calls import PythonicCallStream, parse_pythonic
from router.gateway.qwen3_coder_tool_calls import (
    ToolParameters,
    parse_qwen3_coder,
    qwen3_coder_stream,
)
from router.gateway.reasoning import ReasoningMode, ReasoningStream, split_reasoning


class AutoCallStream(Protocol):
    """One choice's streamed text read for calls by a tool-call parser."""

    @property
    def num_calls(self) -> int:
        """Calls whose header was sent."""
        ...

    @property
    def block_open(self) -> bool:
        """Whether the text ends inside a call (cut, when the sample ended there)."""
        ...

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content and the tool_calls entries of a delta of ``text``."""
        ...

    def end(self) -> tuple[str, list[dict[str, Any]]]:
        """The content still held back once the sample ended, and the tool_calls entries only
        its end decides (``pythonic``'s: a call list is one only once whole)."""
        ...


@dataclass(frozen=True, slots=True)
class _AutoParser:
    """A tool-call parser's readers."""

    # a whole text's content and calls, (name, arguments JSON) each
    parse: Callable[[str], tuple[str | None, list[tuple[str, str]]]]
    stream: Callable[[], AutoCallStream]  # a new reader of one choice's stream
    # a whole response's new call id (a stream's reader makes its own)
    new_call_id: Callable[[], str] = new_tool_call_id
    # the ids a whole text gives its calls, in order, for a format that names each (Kimi K2's
    # functions.NAME:INDEX, which its template writes back); None: new ones
    call_ids: Callable[[str], list[str]] | None = None


_AUTO_PARSERS = {
    "hermes": _AutoParser(parse_hermes, HermesCallStream),
    "llama3_json": _AutoParser(parse_llama3_json, Llama3JsonCallStream),
    # vLLM's other name for it
    "llama4_json": _AutoParser(parse_llama3_json, Llama3JsonCallStream),
    "mistral": _AutoParser(parse_mistral, MistralCallStream, new_mistral_tool_call_id),
    "deepseek_v3": _AutoParser(
        partial(parse_deepseek, "deepseek_v3"), partial(DeepSeekCallStream, "deepseek_v3")
    ),
    "deepseek_v31": _AutoParser(
        partial(parse_deepseek, "deepseek_v31"), partial(DeepSeekCallStream, "deepseek_v31")
    ),
    "pythonic": _AutoParser(
        partial(parse_pythonic, "pythonic"), partial(PythonicCallStream, "pythonic")
    ),
    "llama4_pythonic": _AutoParser(
        partial(parse_pythonic, "llama4_pythonic"), partial(PythonicCallStream, "llama4_pythonic")
    ),
    "kimi_k2": _AutoParser(parse_kimi, KimiCallStream, call_ids=kimi_call_ids),
}


def _qwen3_coder(parameters: ToolParameters) -> _AutoParser:
    return _AutoParser(
        partial(parse_qwen3_coder, parameters), partial(qwen3_coder_stream, parameters)
    )


def _glm(parameters: ToolParameters) -> _AutoParser:
    return _AutoParser(partial(parse_glm, parameters), partial(glm_stream, parameters))


def _minimax(parameters: ToolParameters) -> _AutoParser:
    return _AutoParser(partial(parse_minimax, parameters), partial(minimax_stream, parameters))


# the parsers whose calls' values are typed by the request's tools: their readers for those
_TYPED_PARSERS: dict[str, Callable[[ToolParameters], _AutoParser]] = {
    "qwen3_coder": _qwen3_coder,
    "qwen3_xml": _qwen3_coder,  # vLLM's other parser of the same format
    "glm45": _glm,
    "glm47": _glm,  # GLM-4.7's calls: the same tags, no newlines between them
    "minimax_m2": _minimax,
}
# the formats "auto" tool choice can read calls in: the text's, or harmony's messages
TOOL_CALL_PARSERS = (*_AUTO_PARSERS, *_TYPED_PARSERS, HARMONY_TOOL_CALL_PARSER)


@dataclass(frozen=True, slots=True)
class ForcedToolCalls:
    """How a chat request's constrained output is returned as tool calls."""

    # the named tool_choice's function, whose arguments the output is; None: "required", the
    # output is a JSON array of {"name", "parameters"} calls
    function_name: str | None


@dataclass(frozen=True, slots=True)
class AutoToolCalls:
    """``tool_choice: "auto"``: the output is free text, read for tool calls by a parser."""

    parser: str  # one of TOOL_CALL_PARSERS: the format the model writes its calls in
    # the request's tools' parameter schemas, by function name (read by the typed parsers)
    parameters: ToolParameters = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.parser not in TOOL_CALL_PARSERS:
            supported = ", ".join(TOOL_CALL_PARSERS)
            raise ValueError(f"unknown tool-call parser {self.parser!r} (supported: {supported})")

    def readers(self) -> _AutoParser:
        """The parser's readers of whole and streamed text (harmony's calls are read by
        ``_harmony_message`` and ``ChatDeltas._harmony_delta`` instead)."""
        typed = _TYPED_PARSERS.get(self.parser)
        return typed(self.parameters) if typed is not None else _AUTO_PARSERS[self.parser]


ToolCallMode = ForcedToolCalls | AutoToolCalls  # how a chat's output becomes tool calls


def chat_message(
    text: str,
    finish_reason: str | None,
    tool_calls: ToolCallMode | None = None,
    reasoning: ReasoningMode | None = None,
) -> tuple[dict[str, Any], str | None]:
    """The whole response's message for a choice whose output is ``text``, and its
    finish_reason: the reasoning split off first (``reasoning``, when set), then the rest as
    content or as tool calls (``tool_calls``, when set)."""
    if reasoning is not None and reasoning.harmony:
        return _harmony_message(text, finish_reason, tool_calls, reasoning)
    thought, content = (None, text) if reasoning is None else split_reasoning(reasoning, text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls is not None:
        message, finish_reason = tool_call_choice(tool_calls, content, finish_reason)
    if reasoning is not None:  # vLLM's field, null without reasoning
        message["reasoning"] = thought if reasoning.include else None
    return message, finish_reason


def _harmony_message(
    text: str, finish_reason: str | None, tool_calls: ToolCallMode | None, reasoning: ReasoningMode
) -> tuple[dict[str, Any], str | None]:
    """``chat_message`` for a harmony reply: its calls are its own messages ("auto"), a forced
    call's arguments its content."""
    reply = read_harmony(text)
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if isinstance(tool_calls, AutoToolCalls):
        message["tool_calls"] = [call_entry(name, arguments) for name, arguments in reply.calls]
        finish_reason = _finish_after_calls(finish_reason, bool(reply.calls), reply.call_cut)
    elif tool_calls is not None:
        message, finish_reason = tool_call_choice(tool_calls, reply.content, finish_reason)
    message["reasoning"] = reply.reasoning if reasoning.include else None
    return message, finish_reason


def tool_call_choice(
    mode: ToolCallMode, text: str | None, finish_reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """The whole response's message for a choice whose output is ``text`` (None: none but
    reasoning), and its finish_reason (the sample's, ``tool_calls`` where "auto" found calls,
    as vLLM)."""
    if isinstance(mode, AutoToolCalls):
        parser = mode.readers()
        content, parsed = parser.parse(text) if text is not None else (None, [])
        ids = parser.call_ids(text or "") if parser.call_ids is not None else []
        ids += [parser.new_call_id() for _ in parsed[len(ids) :]]
        calls = [call_entry(n, arguments, i) for (n, arguments), i in zip(parsed, ids, strict=True)]
        cut = bool(calls) and finish_reason == "length" and _ends_in_call(parser, text or "")
        finish_reason = _finish_after_calls(finish_reason, bool(calls), cut)
        return {"role": "assistant", "content": content, "tool_calls": calls}, finish_reason
    text = text or ""
    if mode.function_name is not None:
        calls = [call_entry(mode.function_name, text)]
    else:
        items = _parsed_calls(text)
        if items is None:
            return {"role": "assistant", "content": text, "tool_calls": []}, finish_reason
        calls = [call_entry(name, json.dumps(params, ensure_ascii=False)) for name, params in items]
    return {"role": "assistant", "content": "", "tool_calls": calls}, finish_reason


def _parsed_calls(text: str) -> list[tuple[str, Any]] | None:
    """(name, parameters) of each item of a "required" output; None unless the text is such an
    array (it is, unless max_tokens or a stop string cut it)."""
    try:
        items = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        if "parameters" not in item:
            return None
        calls.append((item["name"], item["parameters"]))
    return calls


class ChatDeltas:
    """Each streamed choice's text deltas as chat deltas: its reasoning first (under a
    reasoning parser), then plain content, or tool calls."""

    def __init__(self, mode: ToolCallMode | None, reasoning: ReasoningMode | None = None) -> None:
        self._mode = mode
        self._reasoning = reasoning
        self._splits: dict[int, ReasoningStream] = {}  # reasoning: per choice
        self._named_started: set[int] = set()  # choices whose named call's header was sent
        self._scanners: dict[int, CallScanner] = {}  # "required": per choice
        self._parsed: dict[int, AutoCallStream] = {}  # "auto": per choice
        self._harmony: dict[int, HarmonyStream] = {}  # a harmony reply: per choice

    def delta(
        self, index: int, text: str, finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """Choice ``index``'s delta for ``text`` and the finish_reason its chunk shows."""
        if self._reasoning is None:
            return self._content(index, text, finish_reason)
        if self._reasoning.harmony:
            return self._harmony_delta(index, text, finish_reason)
        split = self._splits.setdefault(index, ReasoningStream(self._reasoning))
        thought, text = split.feed(text)
        if finish_reason is not None:
            thought += split.end()
        delta, finish_reason = self._content(index, text, finish_reason)
        if thought and self._reasoning.include:
            delta = {"reasoning": thought, **delta}
        return delta, finish_reason

    def _harmony_delta(
        self, index: int, text: str, finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """Choice ``index``'s delta for ``text`` of a harmony reply: its reasoning, then its
        content, and its calls under "auto" (else the content as any other's)."""
        assert self._reasoning is not None
        stream = self._harmony.setdefault(index, HarmonyStream())
        piece = stream.feed(text)
        in_call = stream.in_call  # (before end closes the message)
        if finish_reason is not None:
            piece.add(stream.end())
        if isinstance(self._mode, AutoToolCalls):
            delta: dict[str, Any] = {"content": piece.content} if piece.content else {}
            if piece.calls:
                delta["tool_calls"] = [_call_delta(call) for call in piece.calls]
            finish_reason = _finish_after_calls(finish_reason, stream.num_calls > 0, in_call)
        else:
            delta, finish_reason = self._content(index, piece.content, finish_reason)
        if piece.reasoning and self._reasoning.include:
            delta = {"reasoning": piece.reasoning, **delta}
        return delta, finish_reason

    def _content(
        self, index: int, text: str, finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """Choice ``index``'s delta for ``text`` after the reasoning, as content or calls."""
        if self._mode is None:
            return ({"content": text} if text else {}), finish_reason
        if isinstance(self._mode, AutoToolCalls):
            return self._auto(index, text, finish_reason)
        if self._mode.function_name is not None:
            calls = self._named(index, self._mode.function_name, text, finish_reason)
            called = index in self._named_started
        else:
            scanner = self._scanners.setdefault(index, CallScanner())
            calls = scanner.feed(text)
            called = scanner.num_headers > 0
        if finish_reason == "stop" and called:
            finish_reason = "tool_calls"
        return ({"tool_calls": calls} if calls else {}), finish_reason

    def _named(
        self, index: int, name: str, text: str, finish_reason: str | None
    ) -> list[dict[str, Any]]:
        if index in self._named_started:
            return [{"index": 0, "function": {"arguments": text}}] if text else []
        if not text and finish_reason is None:
            return []
        self._named_started.add(index)  # sent with its first text, or at the end without any
        return [header_entry(0, name, text)]

    def _auto(
        self, index: int, text: str, finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        assert isinstance(self._mode, AutoToolCalls)
        if index not in self._parsed:
            self._parsed[index] = self._mode.readers().stream()
        stream = self._parsed[index]
        content, calls = stream.feed(text)
        if finish_reason is not None:
            held, last_calls = stream.end()
            content, calls = content + held, calls + last_calls
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        finish_reason = _finish_after_calls(finish_reason, stream.num_calls > 0, stream.block_open)
        return delta, finish_reason


def _ends_in_call(parser: _AutoParser, text: str) -> bool:
    """Whether ``text`` ends inside a call (read as a stream reads it): a whole response whose
    calls max_tokens cut says ``length``, as its stream does."""
    stream = parser.stream()
    stream.feed(text)
    stream.end()
    return stream.block_open


def _finish_after_calls(
    finish_reason: str | None, called: bool, in_call: bool = False
) -> str | None:
    """``tool_calls`` for a sample that stopped, or reached max_tokens, after calls (``called``),
    as vLLM says it, unless max_tokens cut a call's text short (``in_call``: the text ended
    inside one); the sample's own finish_reason otherwise."""
    cut = finish_reason == "length" and in_call
    if called and finish_reason in ("stop", "length") and not cut:
        return "tool_calls"
    return finish_reason


def _call_delta(piece: CallPiece) -> dict[str, Any]:
    """A streamed harmony call's piece as a tool_calls entry: its header, or arguments."""
    if piece.name is not None:
        return header_entry(piece.index, piece.name, piece.arguments)
    return {"index": piece.index, "function": {"arguments": piece.arguments}}
