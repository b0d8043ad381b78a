"""Response objects and stream chunks in OpenAI's JSON shapes, built from sample deltas (and
vLLM's ``prompt_logprobs``, formatted in ``prompt_logprobs``; chat's tool calls and reasoning
in ``tool_calls``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.sampling.messages import TokenLogprobs
from router.gateway.prompt_logprobs import shown_logprob
from router.gateway.reasoning import ReasoningMode, num_thought_tokens
from router.gateway.text_stream import SampleDelta, TextGeneration
from router.gateway.tool_calls import ToolCallMode, chat_message


@dataclass(frozen=True, slots=True)
class ResponseHeader:
    id: str  # "cmpl-…" / "chatcmpl-…", generated server-side
    created: int  # unix seconds
    model: str


Decode = Callable[[Sequence[int]], str]  # output token ids to text, as the output was decoded


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens the prefix cache served
    # completion tokens that were the thought (chat under a reasoning parser); None: not counted
    reasoning_tokens: int | None = None

    def body(self) -> dict[str, Any]:
        body = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        if self.reasoning_tokens is not None:
            body["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return body


def total_usage(generations: Sequence[TextGeneration]) -> Usage:
    """The usage of a request's prompts together."""
    return Usage(
        sum(g.num_prompt_tokens for g in generations),
        sum(g.num_completion_tokens for g in generations),
        sum(g.num_cached_tokens for g in generations),
    )


@dataclass(slots=True)
class ChoiceText:
    """One choice's output accumulated: for a non-streaming response, and for a stream's usage
    under a reasoning parser."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # the tokens behind it, counted in usage
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or token id that ended it
    # vLLM's prompt_logprobs of the choice's prompt (``vllm_prompt_logprobs``), when shown
    prompt_logprobs: list[Any] | None = None
    # completions' echo with logprobs: the prompt's entries, which lead the choice's logprobs
    echo_logprobs: dict[str, list[Any]] | None = None

    def add(self, delta: SampleDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self.finish_reason = delta.finish_reason or self.finish_reason
        if delta.stop_reason is not None:
            self.stop_reason = delta.stop_reason


def output_decoder(generation: TextGeneration) -> Decode:
    """How ``generation``'s output token ids were decoded to its text."""
    skip_special_tokens = generation.spec.params.skip_special_tokens
    tokenizer = generation.tokenizer
    return lambda token_ids: str(
        tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    )


def with_reasoning_tokens(
    usage: Usage, choices: Sequence[ChoiceText], reasoning: ReasoningMode | None, decode: Decode
) -> Usage:
    """``usage`` with the completion tokens that were the choices' thought, under a reasoning
    parser (``reasoning``); as it is without one."""
    if reasoning is None:
        return usage
    num_tokens = sum(num_thought_tokens(reasoning, c.text, c.token_ids, decode) for c in choices)
    return dataclasses.replace(usage, reasoning_tokens=num_tokens)


@dataclass(slots=True)
class Echo:
    """What ``echo`` puts at the start of each choice's text, handed out once per choice: a
    stream sends it in the choice's first chunk (with that chunk's text, as vLLM does)."""

    texts: list[str] | None  # per prompt (choice index // n); None: no echo
    n: int  # choices per prompt
    _sent: set[int] = field(default_factory=set)  # choices that had theirs

    def pending(self, index: int) -> bool:
        """Whether choice ``index`` has an echo that ``first`` has not handed out yet."""
        return self.texts is not None and index not in self._sent

    def first(self, index: int) -> str:
        """Choice ``index``'s echo the first time it is asked for; "" after, or without echo."""
        if self.texts is None or index in self._sent:
            return ""
        self._sent.add(index)
        return self.texts[index // self.n]


@dataclass(slots=True)
class TokenIds:
    """vLLM's ``return_token_ids`` on completion choices: every choice (a stream: every chunk)
    shows its output's token ids, and its prompt's once: in the choice (a stream: its first
    chunk)."""

    prompts: list[list[int]] | None  # per prompt (choice index // n); None: not asked for
    n: int  # choices per prompt
    _sent: set[int] = field(default_factory=set)  # choices that showed their prompt's

    def fields(self, index: int, token_ids: Sequence[int]) -> dict[str, list[int]]:
        """The fields choice ``index`` adds for its output tokens ``token_ids``; {} when not
        asked for."""
        if self.prompts is None:
            return {}
        shown: dict[str, list[int]] = {}
        if index not in self._sent:
            self._sent.add(index)
            shown["prompt_token_ids"] = list(self.prompts[index // self.n])
        shown["token_ids"] = list(token_ids)
        return shown


class LogprobsFormatter:
    """Token logprobs as OpenAI shows them: token text, logprob, top alternatives (-inf, which
    structured outputs give the tokens they forbid, as vLLM's -9999.0). ``as_token_ids``:
    vLLM's ``return_tokens_as_token_ids``, each token shown as ``token_id:ID`` instead of its
    text (for clients that need the ids of tokens that do not decode alone)."""

    def __init__(self, tokenizer: Any, as_token_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_token_ids = as_token_ids

    def token_text(self, token_id: int) -> str:
        """A token's decoded text."""
        return str(self.tokenizer.decode([token_id]))

    def shown_token(self, token_id: int) -> str:
        """A token as the logprobs show it: its text, or ``token_id:ID``."""
        return f"token_id:{token_id}" if self.as_token_ids else self.token_text(token_id)

    def completion(
        self,
        logprobs: Sequence[TokenLogprobs],
        offset: int,
        echoed: dict[str, list[Any]] | None = None,
    ) -> dict[str, Any]:
        """The legacy completions shape: parallel lists, plus text offsets from ``offset``.

        ``echoed``: the prompt's entries under echo (``echo_completion_logprobs`` from the same
        ``offset``), which come first; the generated tokens' offsets go on after them.
        """
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        text_offset: list[int] = []
        if echoed is not None:
            tokens, token_logprobs = list(echoed["tokens"]), list(echoed["token_logprobs"])
            top, text_offset = list(echoed["top_logprobs"]), list(echoed["text_offset"])
            offset += sum(map(len, tokens))
        for lp in logprobs:
            text = self.shown_token(lp.sampled_token_id)
            tokens.append(text)
            token_logprobs.append(shown_logprob(lp.sampled_logprob))
            alternatives = {
                self.shown_token(t): shown_logprob(v)
                for t, v in zip(lp.top_token_ids, lp.top_logprobs)
            }
            alternatives.setdefault(text, shown_logprob(lp.sampled_logprob))
            top.append(alternatives)
            text_offset.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": text_offset,
        }

    def chat(self, logprobs: Sequence[TokenLogprobs]) -> dict[str, Any]:
        return {
            "content": [
                {
                    **self._entry(lp.sampled_token_id, lp.sampled_logprob),
                    "top_logprobs": [
                        self._entry(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)
                    ],
                }
                for lp in logprobs
            ]
        }

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.shown_token(token_id)
        return {
            "token": text,
            "logprob": shown_logprob(logprob),
            "bytes": list(text.encode("utf-8")),
        }


def _envelope(header: ResponseHeader, object_name: str, choices: list[Any]) -> dict[str, Any]:
    return {
        "id": header.id,
        "object": object_name,
        "created": header.created,
        "model": header.model,
        "choices": choices,
    }


def completion_response(
    header: ResponseHeader,
    choices: Sequence[ChoiceText],
    usage: Usage,
    logprobs: LogprobsFormatter | None,
    token_ids: TokenIds | None = None,
) -> dict[str, Any]:
    """``token_ids``: the choices' token ids under ``return_token_ids``; None: not shown."""
    body = []
    for i, choice in enumerate(choices):
        entry = {
            "index": i,
            "text": choice.text,
            "logprobs": (
                logprobs.completion(choice.logprobs, 0, choice.echo_logprobs) if logprobs else None
            ),
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,  # vLLM's extra field
        }
        if choice.prompt_logprobs is not None:  # vLLM's extra field, on each choice
            entry["prompt_logprobs"] = choice.prompt_logprobs
        if token_ids is not None:  # vLLM's extra fields, on each choice
            entry.update(token_ids.fields(i, choice.token_ids))
        body.append(entry)
    return {**_envelope(header, "text_completion", body), "usage": usage.body()}


def chat_response(
    header: ResponseHeader,
    choices: Sequence[ChoiceText],
    usage: Usage,
    logprobs: LogprobsFormatter | None,
    tool_calls: ToolCallMode | None = None,
    reasoning: ReasoningMode | None = None,
    decode: Decode | None = None,
    prompt_token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """``tool_calls``: how each choice's text is returned as tool calls; None: as content.
    ``reasoning``: how its reasoning is split off first; None: it is not. ``decode``: how the
    choices' tokens were decoded (``output_decoder``), to count the thought's tokens in the
    usage under a reasoning parser; None: not counted. ``prompt_token_ids``: under vLLM's
    return_token_ids, the prompt's (on the response) and each choice's output's token ids
    are shown; None: not."""
    if decode is not None:
        usage = with_reasoning_tokens(usage, choices, reasoning, decode)
    body = []
    for i, choice in enumerate(choices):
        message, finish_reason = chat_message(
            choice.text, choice.finish_reason, tool_calls, reasoning
        )
        body.append(
            {
                "index": i,
                "message": message,
                "logprobs": logprobs.chat(choice.logprobs) if logprobs else None,
                "finish_reason": finish_reason,
                "stop_reason": choice.stop_reason,  # vLLM's extra field
            }
        )
        if prompt_token_ids is not None:  # vLLM's extra field, on each choice
            body[-1]["token_ids"] = list(choice.token_ids)
    response = {**_envelope(header, "chat.completion", body), "usage": usage.body()}
    if prompt_token_ids is not None:  # vLLM's extra field, on the response: its one prompt
        response["prompt_token_ids"] = list(prompt_token_ids)
    prompt_logprobs = choices[0].prompt_logprobs if choices else None
    if prompt_logprobs is not None:  # vLLM's extra field, on the response: one prompt for all
        response["prompt_logprobs"] = prompt_logprobs
    return response


def completion_chunk(
    header: ResponseHeader,
    index: int,
    delta: SampleDelta,
    logprobs: dict[str, Any] | None,
    token_ids: TokenIds | None = None,
) -> dict[str, Any]:
    """``token_ids``: the choices' token ids under ``return_token_ids``; None: not shown."""
    choice = {
        "index": index,
        "text": delta.text,
        "logprobs": logprobs,
        "finish_reason": delta.finish_reason,
        "stop_reason": delta.stop_reason,  # vLLM's extra field (null until the last chunk)
    }
    if token_ids is not None:
        choice.update(token_ids.fields(index, delta.token_ids))
    return _envelope(header, "text_completion", [choice])


def chat_chunk(
    header: ResponseHeader,
    index: int,
    content: dict[str, Any],
    finish_reason: str | None,
    logprobs: dict[str, Any] | None,
    stop_reason: str | int | None = None,
    token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """``stop_reason``: vLLM's, shown with a finish_reason (on the choice's last chunk);
    ``token_ids``: the chunk's output token ids under vLLM's return_token_ids (None: not
    shown)."""
    choice: dict[str, Any] = {
        "index": index,
        "delta": content,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return _envelope(header, "chat.completion.chunk", [choice])


def usage_chunk(header: ResponseHeader, object_name: str, usage: Usage) -> dict[str, Any]:
    return {**_envelope(header, object_name, []), "usage": usage.body()}
