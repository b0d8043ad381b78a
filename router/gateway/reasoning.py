"""Chat output split into reasoning and content, as vLLM's reasoning parsers split it
(``pdserve serve --reasoning-parser NAME``), for models that think between ``<think>`` and
``</think>`` (DeepSeek-R1, QwQ, Qwen3, GLM-4.5): whole, or streamed.

The think-tag parsers read the output as starting inside the thought, as vLLM's current ones
do: the chat templates of these models open ``<think>`` in the prompt (DeepSeek-R1, QwQ,
Qwen3-Thinking-2507, Qwen3.5), and a ``<think>`` the model writes itself (Qwen3's first
template) is dropped, as is any within the thought (text before it stays reasoning, as in
vLLM's stream; its whole response drops that text). The reasoning runs to the first
``</think>`` (dropped); the rest is the content, as written, null when empty. Without
``</think>`` (the thought cut by ``max_tokens``) it is all reasoning and the content is null.

- ``deepseek_r1``: that alone.
- ``deepseek_v3``: DeepSeek-V3.1's hybrid thinking: as ``deepseek_r1`` when the request's
  ``chat_template_kwargs`` set ``thinking`` (or ``enable_thinking``) true, else all content
  (``reasoning_fields``).
- ``qwen3``: a ``<tool_call>`` before ``</think>`` ends the reasoning too, and stays in the
  content for the tool-call parser (the reasoning is then null when empty). With
  ``chat_template_kwargs: {"enable_thinking": false}`` the template closes the thought in the
  prompt: the output is all content, not read for tags (vLLM's stream; its whole response
  would still split at a ``</think>`` the model wrote anyway).
- ``glm45``: GLM-4.5 to 4.7, as ``qwen3`` (a ``<tool_call>`` ends the reasoning too), thinking
  unless ``chat_template_kwargs`` set ``enable_thinking`` or ``thinking`` and neither is true
  (``reasoning_fields``).
- ``kimi_k2``: Kimi K2 Thinking, as ``qwen3`` with its calls' ``<|tool_calls_section_begin|>``
  for ``<tool_call>``; ``chat_template_kwargs: {"thinking": false}`` gives all content.
- ``minimax_m2``: MiniMax-M2, as ``deepseek_r1``. ``minimax_m2_append_think``: nothing split
  off, the output is the content with ``<think>`` before it (the model's template opens the
  thought in the prompt), so the client keeps the thought for the next turn, as MiniMax
  advises; a stream's first content delta starts with it.

The response carries it as current vLLM does: ``message.reasoning`` (null when none) and
``reasoning`` deltas (vLLM's ``reasoning_content`` until it removed that name, PR #33402).
A stream sends the reasoning as it comes, then the content, split where the whole text is:
text that may be the start of a tag is held back until the next text shows whether it is, and
released as reasoning at the end of the sample if the tag never completes.

``openai_gptoss`` reads gpt-oss's harmony messages instead (``harmony``): the ``analysis``
channel is the reasoning, the rest read message by message.

The usage's ``completion_tokens_details.reasoning_tokens`` counts the thought's tokens where
the split is (``num_thought_tokens``): up to and including the one that completed
``</think>``, those before a qwen3 ``<tool_call>`` that ended it, all without an end tag, none
with thinking off; under ``openai_gptoss``, those of its analysis messages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.gateway.harmony import HARMONY_PARSER, HarmonyStream
from router.gateway.hermes_tool_calls import START as TOOL_CALL_START
from router.gateway.kimi_tool_calls import SECTION_BEGINS as KIMI_CALLS_BEGINS
from router.gateway.tag_scan import TagCutter

# the formats --reasoning-parser reads
# minimax_m2_append_think returns the thought in the content, "<think>" first (as MiniMax
# advises for its interleaved thinking: the thought goes back in the next turn's history)
APPEND_THINK = "minimax_m2_append_think"
REASONING_PARSERS = (
    "deepseek_r1",
    "deepseek_v3",
    "qwen3",
    "glm45",
    "kimi_k2",
    "minimax_m2",
    APPEND_THINK,
    HARMONY_PARSER,
)
# the tags that open the model's tool calls and end its reasoning too, per parser (they stay in
# the content, for the tool-call parser)
_CALL_TAGS = {
    "qwen3": (TOOL_CALL_START,),
    "glm45": (TOOL_CALL_START,),
    "kimi_k2": KIMI_CALLS_BEGINS,
}
THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningMode:
    """How a chat request's output is split into reasoning and content."""

    parser: str  # one of REASONING_PARSERS
    # False: the request turned thinking off (qwen3's enable_thinking false), or did not turn
    # it on (deepseek_v3's thinking): all content
    thinking: bool = True
    # vLLM's include_reasoning: False leaves the reasoning out of the response
    include: bool = True

    def __post_init__(self) -> None:
        if self.parser not in REASONING_PARSERS:
            supported = ", ".join(REASONING_PARSERS)
            raise ValueError(f"unknown reasoning parser {self.parser!r} (supported: {supported})")

    @property
    def harmony(self) -> bool:
        """Whether the output is gpt-oss's harmony messages (``harmony``), not tagged text."""
        return self.parser == HARMONY_PARSER

    @property
    def appends_think(self) -> bool:
        """Whether the thought stays in the content, ``<think>`` before it (not split off)."""
        return self.parser == APPEND_THINK

    @property
    def call_tags(self) -> tuple[str, ...]:
        """The tags that open tool calls, ending the reasoning and staying in the content."""
        return _CALL_TAGS.get(self.parser, ())

    @property
    def end_tags(self) -> tuple[str, ...]:
        """The tags that end the reasoning, the first one written does."""
        return (THINK_END, *self.call_tags)


def split_reasoning(mode: ReasoningMode, text: str) -> tuple[str | None, str | None]:
    """A whole text's reasoning and content, as vLLM's parser returns them (None: null)."""
    if not mode.thinking:
        return None, text
    if mode.appends_think:
        return None, THINK_START + text
    stream = ReasoningStream(mode)  # (a harmony reply is read by read_harmony)
    reasoning, content = stream.feed(text)
    reasoning += stream.end()
    if stream.ended_by is None:
        return reasoning, None
    if stream.ended_by in mode.call_tags:
        return reasoning or None, content
    return reasoning, content or None


class ReasoningStream:
    """One choice's streamed text split into reasoning and content: ``feed`` each text delta,
    then ``end`` once the sample ended. (A harmony reply is read by ``HarmonyStream``.)"""

    def __init__(self, mode: ReasoningMode) -> None:
        assert not mode.harmony
        self._in_reasoning = mode.thinking and not mode.appends_think
        self._prefix = THINK_START if mode.thinking and mode.appends_think else ""
        self._end_tags = mode.end_tags
        self._call_tags = mode.call_tags
        self.ended_by: str | None = None  # the tag that ended the reasoning; None: not yet
        # the text's characters read as the thought so far, its tags (not a <tool_call>) in
        self.num_thought_chars = 0
        tags = (THINK_START, *mode.end_tags)  # looked for in the reasoning only
        self._cutter = TagCutter(lambda: tags if self._in_reasoning else ())

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content of a delta of ``text``."""
        reasoning: list[str] = []
        content: list[str] = [self._prefix]  # (the appended <think>, before the first delta)
        self._prefix = ""
        for piece, tag in self._cutter.feed(text):
            if not self._in_reasoning:
                content.append(piece)
                continue
            reasoning.append(piece)
            self.num_thought_chars += len(piece)
            if tag in self._call_tags:  # it stays in the content, for the tool-call parser
                content.append(tag)
            elif tag is not None:  # </think>, or a <think> within the thought (dropped)
                self.num_thought_chars += len(tag)
            if tag in self._end_tags:
                self._in_reasoning, self.ended_by = False, tag
        return "".join(reasoning), "".join(content)

    def end(self) -> str:
        """The reasoning still held back once the sample ended: a partial tag that never
        completed."""
        return self._cutter.end()


def num_thought_tokens(
    mode: ReasoningMode,
    text: str,
    token_ids: Sequence[int],
    decode: Callable[[Sequence[int]], str],
) -> int:
    """How many of a choice's completion tokens (``token_ids``, its output ``text``) were its
    thought: the fewest whose text (``decode``, as the output was decoded) holds the thought
    the split reads, up to and including ``</think>`` (qwen3, glm45, kimi_k2: up to the tag of
    the calls that ended it); all of them when no tag ended the thought; none with thinking off."""
    if not mode.thinking or mode.appends_think:
        return 0
    if mode.harmony:
        return _harmony_reasoning_tokens(text, token_ids, decode)
    stream = ReasoningStream(mode)
    stream.feed(text)
    if stream.ended_by is None:
        return len(token_ids)
    return _tokens_holding(text[: stream.num_thought_chars], token_ids, decode)


def _harmony_reasoning_tokens(
    text: str, token_ids: Sequence[int], decode: Callable[[Sequence[int]], str]
) -> int:
    """How many of a harmony reply's tokens were its analysis messages, each from its
    ``<|start|>`` to its end tag."""
    stream = HarmonyStream()
    stream.feed(text)
    stream.end()
    return sum(
        _tokens_holding(text[:end], token_ids, decode)
        - _tokens_holding(text[:start], token_ids, decode)
        for start, end in stream.reasoning_spans
    )


def _tokens_holding(
    prefix: str, token_ids: Sequence[int], decode: Callable[[Sequence[int]], str]
) -> int:
    """The fewest of ``token_ids`` whose text (``decode``) holds ``prefix``, a prefix of their
    whole text."""
    if not prefix:
        return 0
    low, high = 0, len(token_ids)  # the first high tokens hold the prefix
    while low < high:  # (fewer tokens decode to a prefix of the text, or a partial character)
        middle = (low + high) // 2
        if decode(token_ids[:middle]).startswith(prefix):
            high = middle
        else:
            low = middle + 1
    return high
