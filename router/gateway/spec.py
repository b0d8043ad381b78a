"""One prompt's generation job as both front doors hand it to the cluster, bounds checked.

The HTTP and gRPC layers parse their own wire formats into plain values; ``make_spec`` applies
the same bounds to both, so a limit is enforced (and worded) once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.sampling.params import SamplingParams
from router.gateway.errors import ApiError, invalid
from router.gateway.limits import RequestLimits
from router.gateway.logit_fields import checked_allowed_token_ids, checked_logit_bias

_INT64_RANGE = (-(2**63), 2**63 - 1)


@dataclass(frozen=True, slots=True)
class GenerationSpec:
    prompt_token_ids: list[int]  # the tokenized prompt (chat template applied, truncated)
    params: SamplingParams  # validated; max_tokens resolved against the context left
    stop: tuple[str, ...]  # stop strings: generation ends at the first, trimmed (or kept, below)
    cache_salt: str | None  # the tenant's prefix-cache salt (set by the gateway, not the client)
    # vLLM's include_stop_str_in_output: a stop string that ends a sample is kept at the end of
    # its text, and so is the text of an eos or stop_token_ids token that ends it
    include_stop_str_in_output: bool = False
    # vLLM's priority: under --scheduling-policy priority, lower is served first (ties by
    # arrival); always 0 under fcfs
    priority: int = 0


def make_spec(
    prompt_token_ids: Sequence[int],
    sampling: Mapping[str, Any],
    stop: Sequence[str],
    *,
    limits: RequestLimits,
    vocab_size: int,
    cache_salt: str | None,
    prompt_param: str = "prompt",
    wire_names: Mapping[str, str] | None = None,
    include_stop_str_in_output: bool = False,
    priority: int = 0,
) -> GenerationSpec:
    """Check a request against the limits and build its spec; ApiError(400) names the field.

    ``sampling`` holds SamplingParams keywords; ``max_tokens`` None means "the context left";
    ``logit_bias`` and ``allowed_token_ids`` come as the wire sent them (``logit_fields``).
    ``wire_names`` maps a keyword to the request field it came from where the two differ (chat's
    ``max_completion_tokens`` and ``top_logprobs``), so that errors name the field sent.
    """
    names = wire_names or {}
    _check_priority(priority, limits)
    prompt = _checked_prompt(prompt_token_ids, limits, vocab_size, prompt_param)
    fields = dict(sampling)
    max_tokens_name = names.get("max_tokens", "max_tokens")
    fields["max_tokens"] = _max_tokens(
        fields.get("max_tokens"), len(prompt), limits, max_tokens_name
    )
    _check_bounds(fields, stop, limits, vocab_size, names.get("logprobs", "logprobs"))
    if fields.get("logit_bias") is not None:
        fields["logit_bias"] = checked_logit_bias(fields["logit_bias"], vocab_size)
    if fields.get("allowed_token_ids") is not None:
        fields["allowed_token_ids"] = checked_allowed_token_ids(
            fields["allowed_token_ids"], vocab_size
        )
    try:
        params = SamplingParams(**fields)
    except ValueError as error:
        keyword = str(error).split(" ", 1)[0]
        wire_name = names.get(keyword, keyword)
        message = str(error).replace(keyword, wire_name, 1)
        raise invalid(message, param=wire_name) from error
    return GenerationSpec(
        prompt, params, tuple(stop), cache_salt, include_stop_str_in_output, priority
    )


def _check_priority(priority: int, limits: RequestLimits) -> None:
    """A priority fits in a signed 64-bit integer (bounded as ``seed`` is: a client's integer
    is unbounded in JSON), and is 0 unless the workers schedule by priority (as vLLM's)."""
    if not _INT64_RANGE[0] <= priority <= _INT64_RANGE[1]:
        raise invalid(
            f"priority must fit in a signed 64-bit integer, got {priority}", param="priority"
        )
    if priority != 0 and limits.scheduling_policy != "priority":
        raise invalid(
            f"priority must be 0 on this server, got {priority}: it serves requests in order "
            f"of arrival (--scheduling-policy {limits.scheduling_policy}); a priority needs "
            "pdserve serve --scheduling-policy priority",
            param="priority",
        )


def _checked_prompt(
    token_ids: Sequence[int], limits: RequestLimits, vocab_size: int, param: str
) -> list[int]:
    prompt = list(token_ids)
    if not prompt:
        raise invalid(f"{param} must not be empty", param=param)
    for token_id in prompt:
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise invalid(f"{param} token ids must be ints", param=param)
        if not 0 <= token_id < vocab_size:
            raise invalid(
                f"{param} holds token id {token_id}, outside the vocabulary [0, {vocab_size})",
                param=param,
            )
    if len(prompt) >= limits.max_model_len:
        raise invalid(
            f"{param} is {len(prompt)} tokens long; this model's maximum context length is "
            f"{limits.max_model_len} tokens, which must also hold at least one output token",
            param=param,
            code="context_length_exceeded",
        )
    return prompt


def _max_tokens(
    value: Any, num_prompt_tokens: int, limits: RequestLimits, name: str = "max_tokens"
) -> int:
    room = limits.max_model_len - num_prompt_tokens
    cap = room if limits.max_tokens is None else min(room, limits.max_tokens)
    if value is None:
        return cap
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{name} must be an integer, got {value!r}", param=name)
    if value < 1:
        raise invalid(f"{name} must be >= 1, got {value}", param=name)
    if limits.max_tokens is not None and value > limits.max_tokens:
        raise invalid(
            f"{name} must be <= {limits.max_tokens} on this server, got {value}", param=name
        )
    if value > room:
        raise invalid(
            f"this model's maximum context length is {limits.max_model_len} tokens; the prompt "
            f"has {num_prompt_tokens} and {name} asks for {value} more (at most {room} fit)",
            param=name,
            code="context_length_exceeded",
        )
    return value


def _check_prompt_logprobs(value: Any, limit: int) -> None:
    name = "prompt_logprobs"
    bounds = f"{name} must be an integer in [0, {limit}]"
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{bounds}, got {type(value).__name__}", param=name)
    if value == -1:
        whole_vocabulary = "vLLM's -1, the logprobs of the whole vocabulary, is not supported"
        raise invalid(f"{bounds}, got -1 ({whole_vocabulary})", param=name)
    if not 0 <= value <= limit:
        raise invalid(f"{bounds}, got {value}", param=name)


def _check_bounds(
    fields: Mapping[str, Any],
    stop: Sequence[str],
    limits: RequestLimits,
    vocab_size: int,
    logprobs_name: str = "logprobs",
) -> None:
    n = fields.get("n", 1)
    if isinstance(n, int) and not isinstance(n, bool) and n > limits.max_n:
        raise invalid(f"n must be <= {limits.max_n}, got {n}", param="n")
    logprobs = fields.get("logprobs")
    if isinstance(logprobs, int) and logprobs > limits.max_logprobs:
        raise invalid(
            f"{logprobs_name} must be <= {limits.max_logprobs}, got {logprobs}",
            param=logprobs_name,
        )
    if isinstance(logprobs, int) and logprobs < 0:  # before prompt_logprobs, which echo sets
        raise invalid(f"{logprobs_name} must be >= 0, got {logprobs}", param=logprobs_name)
    if fields.get("prompt_logprobs") is not None:
        _check_prompt_logprobs(fields["prompt_logprobs"], limits.max_logprobs)
    if len(stop) > limits.max_stop_strings:
        raise invalid(
            f"stop holds {len(stop)} strings; at most {limits.max_stop_strings} are allowed",
            param="stop",
        )
    for i, text in enumerate(stop):
        if len(text) > limits.max_stop_string_chars:
            raise invalid(
                f"stop[{i}] is {len(text)} characters; at most "
                f"{limits.max_stop_string_chars} are allowed",
                param="stop",
            )
    stop_token_ids = fields.get("stop_token_ids", ())
    if isinstance(stop_token_ids, Sequence) and len(stop_token_ids) > limits.max_stop_token_ids:
        raise invalid(
            f"stop_token_ids holds {len(stop_token_ids)} ids; at most "
            f"{limits.max_stop_token_ids} are allowed",
            param="stop_token_ids",
        )
    for token_id in stop_token_ids if isinstance(stop_token_ids, Sequence) else ():
        if isinstance(token_id, int) and not 0 <= token_id < vocab_size:
            raise invalid(
                f"stop_token_ids holds {token_id}, outside the vocabulary [0, {vocab_size})",
                param="stop_token_ids",
            )


__all__ = ["ApiError", "GenerationSpec", "make_spec"]
