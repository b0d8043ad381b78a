"""vLLM's ``truncate_prompt_tokens``: a prompt cut to its last k tokens before it is generated
from, so that one too long for the context still fits.

The rules are vLLM's (``vllm/renderers/params.py``, ``TokenizeParams``): k is at most the
context less ``max_tokens``; -1 means that many; the tokens kept are the last ones. A text prompt
is cut as a Hugging Face tokenizer truncating on the left cuts it, which is how vLLM tokenizes
one: the special tokens the tokenizer adds (a BOS) stay, the text's first tokens go. Token-id
prompts and rendered chats lose their first tokens, whatever they are. Both front doors call
``checked_truncation`` before tokenizing, then ``encode_truncated`` or ``keep_last``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from router.gateway.errors import invalid

NAME = "truncate_prompt_tokens"


def checked_truncation(
    value: Any, max_tokens: Any, max_model_len: int, max_tokens_name: str = "max_tokens"
) -> int | None:
    """How many prompt tokens to keep (None: all), or a 400 naming the field and the limit.

    ``max_tokens`` is the request's, unchecked (None when unset); its own errors are left to
    ``make_spec``, so a bad one counts as unset here.
    """
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 16.0 is 16, as the other integer fields take it
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{NAME} must be an integer, got {type(value).__name__}", param=NAME)
    reserved = max_tokens if _is_int(max_tokens) and 0 < max_tokens < max_model_len else None
    if value == -1:  # the context less max_tokens (less the one token an output needs, unset)
        return max_model_len - (reserved or 1)
    if value < 1:
        raise invalid(
            f"{NAME} must be >= 1, or -1 for the context less max_tokens; got {value}", param=NAME
        )
    limit = max_model_len - (reserved or 0)
    if value > limit:
        less = "" if reserved is None else f" less {max_tokens_name} ({reserved})"
        raise invalid(
            f"{NAME} must be <= {limit} (the context length of {max_model_len} tokens{less}), "
            f"got {value}",
            param=NAME,
        )
    return value


def keep_last(token_ids: Sequence[int], keep: int | None) -> list[int]:
    """The last ``keep`` token ids (all of them when ``keep`` is None)."""
    token_ids = list(token_ids)
    return token_ids if keep is None or len(token_ids) <= keep else token_ids[-keep:]


def encode_truncated(tokenizer: Any, text: str, keep: int | None) -> list[int]:
    """``text`` tokenized as a completion prompt (special tokens added), cut to ``keep`` tokens
    as the tokenizer's own left truncation would: its special tokens stay where it puts them.

    The tokenizer's truncation setting is not used: changing it would change a fast tokenizer's
    state, which threads share (see ``ServedModel.load``).
    """
    token_ids = list(tokenizer.encode(text))
    if keep is None or len(token_ids) <= keep:
        return token_ids
    body = list(tokenizer.encode(text, add_special_tokens=False))
    num_added = len(token_ids) - len(body)
    if 0 < num_added < keep:
        for start in range(num_added + 1):  # where the special tokens leave the text's tokens
            if token_ids[start : start + len(body)] == body:
                kept = body[len(body) - (keep - num_added) :]
                return token_ids[:start] + kept + token_ids[start + len(body) :]
    return token_ids[-keep:]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
