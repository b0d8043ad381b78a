"""OpenAI request bodies (parsed JSON) to validated jobs: the HTTP gateway's edge.

Every field is type-checked by hand so each error names the field and the rule it broke.
Fields OpenAI or vLLM define but pdserve does not implement are refused when they would change
the output (``suffix``, tools, grammars ...: ``unsupported``), never silently ignored;
unknown fields are ignored, as vLLM does. vLLM's extra sampling fields (``allowed_token_ids``
among them) and chat-template options are accepted in the body, and so is OpenAI's
``logit_bias`` (checked in ``logit_fields``, which also tokenizes vLLM's ``bad_words``). Prompts
are cut to ``truncate_prompt_tokens`` (``truncation``) as they are tokenized; ``echo`` is kept
on the job for the response to apply. vLLM's ``prompt_logprobs``, and ``echo`` with ``logprobs``
on completions, ask the workers for the prompt's logprobs (``prompt_logprobs``) as vLLM does.
vLLM's ``priority`` goes with every prompt's job (0 unless the workers schedule by priority).
vLLM's ``return_token_ids`` has each choice show its output's token ids and its prompt's (on
chat, the response shows them).
Structured outputs (``response_format``, ``structured_outputs``, ``guided_*``) are checked in
``structured_fields``; chat's ``tools`` and ``tool_choice``, which may constrain the output
instead, in ``tool_fields``; under ``--reasoning-parser``, chat's reasoning options and the
constraints refused with them in ``reasoning_fields``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from engine.structured.spec import StructuredOutputSpec
from router.gateway.auth import Caller
from router.gateway.beam_fields import BeamOptions, check_beam_search, checked_beam_options
from router.gateway.chat import (
    check_prompt_chars,
    check_text,
    checked_documents,
    parse_messages,
    render_chat,
    template_kwargs,
    template_options,
)
from router.gateway.errors import ApiError, invalid
from router.gateway.limits import RequestLimits
from router.gateway.logit_fields import checked_bad_words
from router.gateway.openai_response import (
    ChoiceText,
    Decode,
    LogprobsFormatter,
    ResponseHeader,
    TokenIds,
    Usage,
    chat_response,
    completion_response,
)
from router.gateway.reasoning import ReasoningMode
from router.gateway.reasoning_fields import checked_reasoning, constrained_after_reasoning
from router.gateway.served_model import ServedModel
from router.gateway.spec import GenerationSpec, make_spec
from router.gateway.tool_calls import AutoToolCalls, ToolCallMode
from router.gateway.tool_fields import ChatTools, checked_tools, output_constraint
from router.gateway.truncation import NAME as TRUNCATE
from router.gateway.truncation import checked_truncation, encode_truncated, keep_last
from router.gateway.unsupported import check_unsupported

_SEED_RANGE = (-(2**63), 2**63 - 1)
_COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default; chat has none


@dataclass(frozen=True, slots=True)
class OpenAIJob:
    kind: Literal["completion", "chat"]
    specs: list[GenerationSpec]  # one per prompt; choice index = prompt index * n + sample
    n: int  # samples per prompt
    stream: bool
    include_usage: bool  # stream a final usage chunk (stream_options.include_usage)
    logprobs: int | None  # top-N logprobs to return per token; None: no logprobs
    # echo: per prompt, the text each of its choices starts with; None: no echo
    echo_texts: list[str] | None = None
    # completions' echo with logprobs: each choice's logprobs start with its prompt's tokens
    echo_logprobs: bool = False
    # completions' echo with max_tokens 0: each choice is its prompt alone. The workers generate
    # one token (they need max_tokens >= 1, as vLLM's engine does), which is not shown
    echo_only: bool = False
    # whole responses carry vLLM's prompt_logprobs (asked for, or computed for echo_logprobs)
    show_prompt_logprobs: bool = False
    # chat: how the output is returned as tool calls (a named, "required" or "auto"
    # tool_choice); None: as content
    tool_calls: ToolCallMode | None = None
    # chat under --reasoning-parser: how the output's reasoning is split off first; None: not
    reasoning: ReasoningMode | None = None
    # vLLM's return_token_ids: each choice carries its output's token ids (streamed: per chunk)
    # and its prompt's (completions: in the choice, streamed in its first chunk; chat: on the
    # response, streamed on the role chunks)
    return_token_ids: bool = False
    # vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries its
    # choice's usage so far (its prompt's tokens, the choice's completion tokens)
    continuous_usage: bool = False
    # vLLM's return_tokens_as_token_ids: the logprobs show each token as "token_id:ID"
    tokens_as_ids: bool = False
    # vLLM's use_beam_search: each prompt's n choices are its n best beams (beam_fields)
    beam_search: BeamOptions | None = None

    def logprobs_formatter(self, tokenizer: Any) -> LogprobsFormatter | None:
        """How the choices' logprobs are shown; None when the request asked for none."""
        if self.logprobs is None:
            return None
        return LogprobsFormatter(tokenizer, self.tokens_as_ids)

    def response_body(
        self,
        header: ResponseHeader,
        choices: list[ChoiceText],
        usage: Usage,
        tokenizer: Any,
        decode: Decode,
    ) -> dict[str, Any]:
        """The whole response of these choices, in the endpoint's shape; ``decode``: how the
        outputs' tokens were decoded (chat counts its reasoning's tokens with it)."""
        logprobs = self.logprobs_formatter(tokenizer)
        prompts = self.returned_prompt_token_ids()
        if self.kind == "completion":
            return completion_response(header, choices, usage, logprobs, TokenIds(prompts, self.n))
        return chat_response(
            header,
            choices,
            usage,
            logprobs,
            self.tool_calls,
            self.reasoning,
            decode,
            prompt_token_ids=prompts[0] if prompts is not None else None,  # (chat: one prompt)
        )

    def returned_prompt_token_ids(self) -> list[list[int]] | None:
        """Per prompt, the token ids its choices return under ``return_token_ids``; None when
        the request did not ask for them."""
        if not self.return_token_ids:
            return None
        return [spec.prompt_token_ids for spec in self.specs]


@dataclass(frozen=True, slots=True)
class _Prompts:
    """A request's prompts as token ids, and what its other fields need of them."""

    token_ids: list[list[int]]  # one list per prompt, already truncated
    texts: list[str | None]  # each prompt's text as sent; None: sent as token ids
    max_tokens: int | None  # the request's max_tokens (max_completion_tokens), None: unset
    logprobs: int | None  # top-N logprobs asked for; None: none
    echo: bool  # the request's echo
    chat_echo: str = ""  # chat: the text vLLM's echo starts each choice with
    echo_only: bool = False  # completions: echo with max_tokens 0 (max_tokens is then 1)


def parse_job(
    kind: Literal["completion", "chat"],
    body: Any,
    model: ServedModel,
    limits: RequestLimits,
    caller: Caller,
) -> OpenAIJob:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    check_model(body, model)
    check_unsupported(kind, body)
    beam_search = checked_beam_options(body)
    optional_field(body, "user", str)
    stream = optional_field(body, "stream", bool) or False
    include_usage, continuous_usage = _stream_options(body, stream)
    include_stop = optional_field(body, "include_stop_str_in_output", bool, False)
    # (refused on chat by check_unsupported when true)
    return_token_ids = optional_field(body, "return_token_ids", bool, False)
    tokens_as_ids = optional_field(body, "return_tokens_as_token_ids", bool, False)
    priority = optional_field(body, "priority", int, 0)  # checked in make_spec, as gRPC's
    wire_names: dict[str, str] = {}
    tools: ChatTools | None = None
    reasoning: ReasoningMode | None = None
    if kind == "chat":
        tools = checked_tools(body, model.tool_call_parser)
        # the template's variables: they render the prompt and decide whether a model thinks
        variables = template_kwargs(body.get("chat_template_kwargs"), body.get("reasoning_effort"))
        reasoning = checked_reasoning(body, model.reasoning_parser, variables)
        wire_names["logprobs"] = "top_logprobs"
        if body.get("max_completion_tokens") is not None:
            wire_names["max_tokens"] = "max_completion_tokens"
        if tools.constraint is not None:  # the tools' constraint is the one the params check
            wire_names["structured_outputs"] = "tool_choice"
        max_tokens_name = wire_names.get("max_tokens", "max_tokens")
        prompts = _chat_prompts(body, model, limits, max_tokens_name, tools.tools, variables)
    else:
        prompts = _completion_prompts(body, model, limits)
    sampling = _sampling_fields(body)
    if _parsers_read_tags(tools, reasoning):
        sampling["skip_special_tokens"] = False
    if body.get("bad_words") is not None:  # tokenized once for every prompt
        sampling["bad_words_token_ids"] = checked_bad_words(
            body["bad_words"], model.tokenizer, model.vocab_size
        )
    sampling["structured_outputs"] = _output_constraint(body, tools, reasoning, model)
    sampling["max_tokens"] = prompts.max_tokens
    # include_reasoning false hides the logprobs too (they would show the reasoning), as vLLM
    logprobs = prompts.logprobs if reasoning is None or reasoning.include else None
    sampling["logprobs"] = logprobs
    echo_logprobs = kind == "completion" and prompts.echo and prompts.logprobs is not None
    sampling["prompt_logprobs"] = _prompt_logprobs(body, stream, echo_logprobs, prompts.logprobs)
    stop = _stop_strings(body)
    specs = [
        make_spec(
            prompt,
            sampling,
            stop,
            limits=limits,
            vocab_size=model.vocab_size,
            cache_salt=caller.tenant_salt,
            prompt_param="messages" if kind == "chat" else "prompt",
            wire_names=wire_names,
            include_stop_str_in_output=include_stop,
            priority=priority,
        )
        for prompt in prompts.token_ids
    ]
    echo_texts = _echo_texts(kind, prompts, specs, model) if prompts.echo else None
    n = specs[0].params.n
    if beam_search is not None:
        check_beam_search(body, specs, beam_search, len(model.eos_token_ids))
    return OpenAIJob(
        kind,
        specs,
        n,
        stream,
        include_usage,
        logprobs,
        echo_texts,
        echo_logprobs=echo_logprobs,
        echo_only=prompts.echo_only,
        show_prompt_logprobs=not stream and sampling["prompt_logprobs"] is not None,
        tool_calls=tools.mode if tools is not None else None,
        reasoning=reasoning,
        return_token_ids=return_token_ids,
        continuous_usage=continuous_usage,
        tokens_as_ids=tokens_as_ids,
        beam_search=beam_search,
    )


def _parsers_read_tags(tools: ChatTools | None, reasoning: ReasoningMode | None) -> bool:
    """Whether a parser reads tags from the output: "auto" tool calls, or a reasoning split
    while thinking. In many models the tags are special tokens: then kept whatever the request
    says, as vLLM's hermes parser keeps them."""
    auto_tools = tools is not None and isinstance(tools.mode, AutoToolCalls)
    return auto_tools or (reasoning is not None and reasoning.thinking)


def _output_constraint(
    body: dict[str, Any],
    tools: ChatTools | None,
    reasoning: ReasoningMode | None,
    model: ServedModel,
) -> StructuredOutputSpec | None:
    """The request's one output constraint, if any; under a reasoning parser, from where the
    reasoning ends (``reasoning_fields``)."""
    constraint = output_constraint(body, tools)
    if constraint is None:
        return None
    if reasoning is not None:
        return constrained_after_reasoning(reasoning, constraint[1], model.reasoning_end_token_ids)
    return constraint[1]


def _chat_prompts(
    body: dict[str, Any],
    model: ServedModel,
    limits: RequestLimits,
    max_tokens_name: str,
    tools: list[dict[str, Any]] | None,
    variables: dict[str, Any],
) -> _Prompts:
    max_tokens = _chat_max_tokens(body)
    keep = checked_truncation(body.get(TRUNCATE), max_tokens, model.max_model_len, max_tokens_name)
    messages = parse_messages(body.get("messages"), limits, keep is None, model.harmony)
    options = template_options(
        optional_field(body, "add_generation_prompt", bool, True),
        optional_field(body, "continue_final_message", bool, False),
        variables,
        tools,
        checked_documents(body.get("documents"), limits),
    )
    token_ids = keep_last(render_chat(model.tokenizer, messages, options), keep)
    echo = optional_field(body, "echo", bool) or False
    logprobs = _chat_logprobs(body)
    # vLLM's chat echo: the reply starts with the last message when it is in the reply's role
    # (the assistant's, or the last message's own when no generation prompt opens a new turn)
    last = messages[-1]
    echoed = not options.add_generation_prompt or last["role"] == "assistant"
    chat_echo = last["content"] if echoed else ""
    return _Prompts([token_ids], [None], max_tokens, logprobs, echo, chat_echo)


def _completion_prompts(
    body: dict[str, Any], model: ServedModel, limits: RequestLimits
) -> _Prompts:
    max_tokens = optional_field(body, "max_tokens", int, _COMPLETION_DEFAULT_MAX_TOKENS)
    logprobs = optional_field(body, "logprobs", int)
    echo = optional_field(body, "echo", bool) or False
    echo_only = echo and max_tokens == 0  # the prompt alone, as vLLM (lm-eval's scoring)
    if echo_only:
        max_tokens = 1  # what vLLM asks its engine for; the token is not shown
    elif max_tokens == 0:
        raise invalid(
            "max_tokens must be >= 1, got 0 (0 is allowed only with echo, which then returns "
            "the prompt alone)",
            param="max_tokens",
        )
    keep = checked_truncation(body.get(TRUNCATE), max_tokens, model.max_model_len)
    items = _prompt_items(body, limits)
    token_ids = [
        _encode(model, item, param, keep) if isinstance(item, str) else keep_last(item, keep)
        for param, item in items
    ]
    texts = [item if isinstance(item, str) else None for _, item in items]
    return _Prompts(token_ids, texts, max_tokens, logprobs, echo, echo_only=echo_only)


def _prompt_logprobs(
    body: dict[str, Any], stream: bool, echo_logprobs: bool, logprobs: int | None
) -> int | None:
    """The N of the prompt logprobs the workers are asked for (bounds checked in make_spec):
    vLLM's ``prompt_logprobs``, else ``logprobs``' N when echo shows the prompt's, as vLLM
    sets them; None: none. A stream cannot show them: > 0 is refused there, as vLLM does."""
    value: int | None = optional_field(body, "prompt_logprobs", int)
    if stream and value is not None and value > 0:
        raise invalid(
            "prompt_logprobs is not available with stream: true (as in vLLM); send it without "
            "stream",
            param="prompt_logprobs",
        )
    if value is None and echo_logprobs:
        return logprobs
    return value


def _echo_texts(
    kind: Literal["completion", "chat"],
    prompts: _Prompts,
    specs: list[GenerationSpec],
    model: ServedModel,
) -> list[str]:
    """What each prompt's choices start with: the prompt's text as sent, or (token ids) the
    ones generated from decoded, special tokens included, as vLLM echoes them."""
    if kind == "chat":
        return [prompts.chat_echo]
    return [
        text if text is not None else str(model.tokenizer.decode(spec.prompt_token_ids))
        for text, spec in zip(prompts.texts, specs)
    ]


def check_model(body: dict[str, Any], model: ServedModel) -> None:
    """A ``model`` given must be the served one: 404 otherwise, as OpenAI answers."""
    name = optional_field(body, "model", str)
    if name is not None and name != model.name:
        raise ApiError(
            404,
            f"the model {name!r} does not exist; this server serves {model.name!r}",
            param="model",
            code="model_not_found",
        )


def _stream_options(body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    """include_usage, and continuous usage (vLLM's continuous_usage_stats, which takes effect
    with include_usage, as in vLLM)."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict):
        raise invalid("stream_options must be an object", param="stream_options")
    include_usage = optional_field(
        options, "include_usage", bool, False, "stream_options.include_usage"
    )
    continuous = optional_field(
        options, "continuous_usage_stats", bool, False, "stream_options.continuous_usage_stats"
    )
    return include_usage, include_usage and continuous


def _prompt_items(body: dict[str, Any], limits: RequestLimits) -> list[tuple[str, str | list[int]]]:
    """``prompt``'s prompts, each a string or a list of token ids (ints), with its field name."""
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid("prompt is required", param="prompt")
    if isinstance(prompt, str):
        return [("prompt", check_text(prompt, "prompt"))]
    if not isinstance(prompt, list) or not prompt:
        raise invalid(
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists, and not empty",
            param="prompt",
        )
    if all(_is_int(t) for t in prompt):
        return [("prompt", prompt)]
    if len(prompt) > limits.max_prompts:
        raise invalid(
            f"prompt holds {len(prompt)} prompts; at most {limits.max_prompts} are allowed",
            param="prompt",
        )
    prompts: list[tuple[str, str | list[int]]] = []
    for i, item in enumerate(prompt):
        if isinstance(item, str):
            prompts.append((f"prompt[{i}]", check_text(item, f"prompt[{i}]")))
        elif isinstance(item, list) and all(_is_int(t) for t in item):
            prompts.append((f"prompt[{i}]", item))
        else:
            raise invalid(
                f"prompt[{i}] must be a string or a list of token ids", param=f"prompt[{i}]"
            )
    return prompts


def _encode(model: ServedModel, text: str, param: str, keep: int | None) -> list[int]:
    if keep is None:  # one to be truncated may be longer: the body's size bounds it
        check_prompt_chars(len(text), param, model.max_model_len)
    return encode_truncated(model.tokenizer, text, keep)


def _chat_max_tokens(body: dict[str, Any]) -> int | None:
    value = optional_field(body, "max_completion_tokens", int)
    if value is None:
        value = optional_field(body, "max_tokens", int)
    return value


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    logprobs = optional_field(body, "logprobs", bool) or False
    top = optional_field(body, "top_logprobs", int)
    if top is not None and not logprobs:
        raise invalid("top_logprobs requires logprobs to be true", param="top_logprobs")
    if top is not None and top < 0:
        raise invalid(f"top_logprobs must be >= 0, got {top}", param="top_logprobs")
    return (top or 0) if logprobs else None


def _sampling_fields(body: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for name, kind in (
        ("temperature", float),
        ("top_p", float),
        ("n", int),
        ("presence_penalty", float),
        ("frequency_penalty", float),
        ("top_k", int),
        ("min_p", float),
        ("repetition_penalty", float),
        ("min_tokens", int),
        ("ignore_eos", bool),
        ("skip_special_tokens", bool),
    ):
        value = optional_field(body, name, kind)
        if value is not None:
            fields[name] = value
    seed = optional_field(body, "seed", int)
    if seed is not None and not _SEED_RANGE[0] <= seed <= _SEED_RANGE[1]:
        raise invalid(f"seed must fit in a signed 64-bit integer, got {seed}", param="seed")
    fields["seed"] = seed
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None:
        if not isinstance(stop_token_ids, list) or not all(_is_int(t) for t in stop_token_ids):
            raise invalid("stop_token_ids must be a list of integers", param="stop_token_ids")
        fields["stop_token_ids"] = stop_token_ids
    for name in ("logit_bias", "allowed_token_ids"):  # checked in make_spec, as gRPC's are
        if body.get(name) is not None:
            fields[name] = body[name]
    return fields


def _stop_strings(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid("stop must be a string or a list of strings", param="stop")
    return [check_text(s, "stop") for s in stop]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def optional_field(
    body: dict[str, Any],
    name: str,
    kind: type,
    default: Any = None,
    param: str | None = None,
) -> Any:
    """``body[name]`` checked to be a ``kind`` (ints pass as floats), or ``default``."""
    value = body.get(name)
    if value is None:
        return default
    if kind is float and _is_int(value):
        try:
            return float(value)
        except OverflowError:
            message = f"{param or name} is too large for a floating-point number"
            raise invalid(message, param=param or name) from None
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)  # 16.0 is 16, as OpenAI's API accepts
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        expected = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}
        raise invalid(
            f"{param or name} must be {expected.get(kind, kind.__name__)}, "
            f"got {type(value).__name__}",
            param=param or name,
        )
    return value
