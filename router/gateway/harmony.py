"""gpt-oss's replies read as chat messages: the harmony format (``--reasoning-parser
openai_gptoss``, the parser a ``gpt_oss`` model is served with by default, as vLLM reads every
gpt-oss reply), whole or streamed.

A gpt-oss reply is a run of messages. The prompt ends by opening the assistant's first one
(``<|start|>assistant``), so the output starts in that message's header; each message is a
header, ``<|message|>``, its body, and an end tag (``<|end|>``, or ``<|call|>`` / ``<|return|>``,
which end the sample and so are not in the text); the next one opens with ``<|start|>`` and its
role. The header names the message's channel (``<|channel|>analysis``) and its recipient, if any
(`` to=functions.get_weather``, before or after the channel), then maybe a content type::

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}

Each assistant message goes where vLLM puts it:

- a recipient ``functions.NAME``, on any channel: a call of NAME, its body the arguments (as
  written), with ``--tool-call-parser openai`` (``tool_choice: "auto"``); otherwise dropped;
- ``analysis``: the reasoning;
- ``final``, and ``commentary`` without a recipient (a preamble the model shows the user): the
  content;
- anything else (another role, a built-in tool's recipient on ``commentary``, an unknown
  channel): dropped.

Several messages of the reasoning (or of the content) are joined by a newline, streamed or
whole; empty reasoning or content is null. A tag met where it cannot stand is read leniently: a
``<|channel|>`` inside a body ends that message and starts an assistant one; text between
messages, and ``<|message|>`` or ``<|constrain|>`` inside a body, are dropped (special tokens are
not shown). A header with no body (the sample cut inside it) shows nothing.

A stream sends each message's text as it comes; a call's header (index, id, type, name) when its
body starts, then its arguments as they come. Tags are special tokens in gpt-oss, so the text is
decoded with them (``skip_special_tokens`` false under this parser); a tag split over deltas is
held back until the next text shows whether it is one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from router.gateway.tag_scan import TagCutter

HARMONY_PARSER = "openai_gptoss"  # the --reasoning-parser name (vLLM's) of this format
HARMONY_TOOL_CALL_PARSER = "openai"  # the --tool-call-parser name (vLLM's) of its calls
START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
END = "<|end|>"
CONSTRAIN = "<|constrain|>"
CALL = "<|call|>"
RETURN = "<|return|>"
# where the reply's final answer starts: an output constraint (response_format ...) holds from
# the token after it, as vLLM's gpt-oss reasoning parser ends the reasoning there
FINAL_START = f"{CHANNEL}final{MESSAGE}"
_TAGS = (START, CHANNEL, MESSAGE, END, CONSTRAIN, CALL, RETURN)
_MESSAGE_ENDS = (END, CALL, RETURN)
_FUNCTIONS = "functions."
_ROLE = re.compile(r"\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


@dataclass(frozen=True, slots=True)
class _Destination:
    """Where a message's body goes."""

    kind: Literal["reasoning", "content", "call"]
    function: str = ""  # a call's function name


@dataclass(frozen=True, slots=True)
class CallPiece:
    """A piece of a streamed call: its header (``name`` set, sent once) or arguments text."""

    index: int  # the call's tool_calls index, 0, 1, 2 ... in the order the calls start
    name: str | None  # the function, on the call's first piece; None on later ones
    arguments: str  # the arguments' text this piece adds


@dataclass(slots=True)
class HarmonyDelta:
    """What a delta of a reply's text adds to its reasoning, content and calls."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallPiece] = field(default_factory=list)

    def add(self, later: HarmonyDelta) -> None:
        """Appends what a later delta adds."""
        self.reasoning += later.reasoning
        self.content += later.content
        self.calls += later.calls


@dataclass(frozen=True, slots=True)
class HarmonyReply:
    """A whole reply read: its reasoning and content (None: empty) and its calls."""

    reasoning: str | None
    content: str | None
    calls: list[tuple[str, str]]  # (function name, arguments text) each, in order
    call_cut: bool  # the text ends inside a call's arguments (cut, if the sample ended there)


class HarmonyStream:
    """One choice's streamed reply read as harmony messages: ``feed`` each text delta, then
    ``end`` once the sample ended."""

    def __init__(self) -> None:
        self._cutter = TagCutter(lambda: _TAGS)
        self._part: Literal["header", "body", "between"] = "header"
        self._header = ""  # the open message's header text so far, its tags in
        self._role_given = True  # the open message's role came before its header (the prompt's)
        self._to: _Destination | None = None  # the open body's destination; None: dropped
        self._shown: set[str] = set()  # where a message has gone, so the next is joined
        self.num_calls = 0  # calls whose header was sent
        self._at = 0  # characters read, tags included
        self._message_start = 0  # where the open message starts in the text
        # [start, end) of each reasoning message in the text, tags included
        self.reasoning_spans: list[tuple[int, int]] = []

    @property
    def in_call(self) -> bool:
        """Whether the text read so far ends inside a call's arguments."""
        return self._part == "body" and self._to is not None and self._to.kind == "call"

    def feed(self, text: str) -> HarmonyDelta:
        """The reasoning, content and call pieces of a delta of ``text``."""
        delta = HarmonyDelta()
        for piece, tag in self._cutter.feed(text):
            self._text(piece, delta)
            if tag is not None:
                self._tag(tag, delta)
        return delta

    def end(self) -> HarmonyDelta:
        """What the text held back adds once the sample ended (a partial tag that never
        completed is text), the open message closed at the end."""
        delta = HarmonyDelta()
        self._text(self._cutter.end(), delta)
        self._close(self._at)
        return delta

    def _text(self, text: str, delta: HarmonyDelta) -> None:
        self._at += len(text)
        if self._part == "header":
            self._header += text
        elif self._part == "body" and self._to is not None and text:
            if self._to.kind == "call":
                delta.calls.append(CallPiece(self.num_calls - 1, None, text))
            elif self._to.kind == "reasoning":
                delta.reasoning += text
            else:
                delta.content += text

    def _tag(self, tag: str, delta: HarmonyDelta) -> None:
        start = self._at
        self._at += len(tag)
        if tag == START:
            self._close(start)
            self._open(start, role_given=False)
        elif tag in _MESSAGE_ENDS:
            self._close(self._at)
            self._part = "between"
        elif tag == CHANNEL and self._part != "header":
            self._close(start)
            self._open(start, role_given=True)
            self._header = tag
        elif tag == MESSAGE and self._part == "header":
            self._start_body(delta)
        elif self._part == "header":  # <|channel|> or <|constrain|> within the header
            self._header += tag

    def _open(self, start: int, role_given: bool) -> None:
        self._part, self._header, self._role_given = "header", "", role_given
        self._message_start, self._to = start, None

    def _close(self, end: int) -> None:
        """Ends the open message at ``end``; noted if it was reasoning."""
        if self._part == "body" and self._to is not None and self._to.kind == "reasoning":
            self.reasoning_spans.append((self._message_start, end))
        self._part, self._to = "between", None

    def _start_body(self, delta: HarmonyDelta) -> None:
        self._part = "body"
        self._to = _destination(self._header, self._role_given)
        if self._to is None:
            return
        if self._to.kind == "call":
            delta.calls.append(CallPiece(self.num_calls, self._to.function, ""))
            self.num_calls += 1
            return
        if self._to.kind in self._shown:  # a later message of the same kind: joined by "\n"
            if self._to.kind == "reasoning":
                delta.reasoning += "\n"
            else:
                delta.content += "\n"
        self._shown.add(self._to.kind)


def _destination(header: str, role_given: bool) -> _Destination | None:
    """Where the body of a message with ``header`` goes; None: dropped. ``role_given``: the
    header does not start with the role (the prompt gave it: the assistant's)."""
    if not role_given:
        role = _ROLE.match(header)
        if role is None or role.group(1) != "assistant":
            return None
    recipient = _RECIPIENT.search(header)
    to = recipient.group(1) if recipient is not None else None
    if to is not None and to.startswith(_FUNCTIONS) and len(to) > len(_FUNCTIONS):
        return _Destination("call", to[len(_FUNCTIONS) :])
    channel = _CHANNEL_NAME.search(header)
    name = channel.group(1) if channel is not None else None
    if name == "analysis":
        return _Destination("reasoning")
    if name == "final" or (name == "commentary" and to is None):
        return _Destination("content")
    return None


def read_harmony(text: str) -> HarmonyReply:
    """A whole reply's reasoning, content and calls, as its stream puts them together."""
    stream = HarmonyStream()
    whole = stream.feed(text)
    call_cut = stream.in_call
    whole.add(stream.end())
    calls: list[tuple[str, list[str]]] = []
    for piece in whole.calls:
        if piece.name is not None:
            calls.append((piece.name, []))
        calls[piece.index][1].append(piece.arguments)
    return HarmonyReply(
        whole.reasoning or None,
        whole.content or None,
        [(name, "".join(arguments)) for name, arguments in calls],
        call_cut,
    )
