"""``logit_bias``, ``allowed_token_ids`` and ``bad_words`` as either front door sends them,
checked.

OpenAI's ``logit_bias`` is a JSON object whose keys are token ids written as strings
(``{"50256": -100}``); gRPC's is a ``map<int32, double>``. Both become ``{token id: bias}``
here, each id in the model's vocabulary, each bias in [-100, 100], at most
``MAX_LOGIT_BIAS_ENTRIES`` of them. vLLM's ``allowed_token_ids`` is a non-empty list of ids in
the vocabulary. An error names the entry as the client wrote it (``logit_bias["99999"]``) and
the limit it broke; ``param`` is the field. vLLM's ``bad_words`` is a list of strings, tokenized
here with the served model's tokenizer as vLLM does (``engine.tokenizer.bad_words_token_ids``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine.sampling.params import (
    MAX_BAD_WORDS_TOTAL_TOKENS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_NUM_BAD_WORDS,
)
from engine.tokenizer import bad_words_token_ids
from router.gateway.chat import check_text
from router.gateway.errors import invalid

_TOKEN_ID_KEY = re.compile(r"-?[0-9]+")  # what a JSON key naming a token id may look like
_MAX_KEY_CHARS = 20  # a signed 64-bit integer's digits
MAX_BAD_WORD_CHARS = 256  # characters in one bad word: bounds the tokenizer's work before it runs


def checked_logit_bias(value: Any, vocab_size: int) -> dict[int, float]:
    """``{token id: bias}`` from a JSON object (string keys) or a gRPC map (int keys)."""
    if not isinstance(value, dict):
        raise invalid(
            f"logit_bias must be an object mapping token ids to biases, got {_kind(value)}",
            param="logit_bias",
        )
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid(
            f"logit_bias holds {len(value)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed",
            param="logit_bias",
        )
    biases: dict[int, float] = {}
    for key, bias in value.items():
        label = f"logit_bias[{json.dumps(key)}]"
        token_id = _token_id(key, label, vocab_size)
        if token_id in biases:
            raise invalid(f"{label} names token id {token_id} a second time", param="logit_bias")
        biases[token_id] = _bias(bias, label)
    return biases


def checked_allowed_token_ids(value: Any, vocab_size: int) -> list[int]:
    """The ids of a non-empty list, each in [0, vocab_size)."""
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise invalid("allowed_token_ids must be a list of integers", param="allowed_token_ids")
    if not value:
        raise invalid(
            "allowed_token_ids must hold at least 1 token id (leave it out to allow every token)",
            param="allowed_token_ids",
        )
    for i, token_id in enumerate(value):
        if not 0 <= token_id < vocab_size:
            raise invalid(
                f"allowed_token_ids[{i}] is token id {token_id}, outside the vocabulary "
                f"[0, {vocab_size})",
                param="allowed_token_ids",
            )
    return value


def checked_bad_words(value: Any, tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """The token sequences of a list of at most ``MAX_NUM_BAD_WORDS`` strings, as vLLM makes
    them; at most ``MAX_NUM_BAD_WORDS`` sequences and ``MAX_BAD_WORDS_TOTAL_TOKENS`` ids."""
    if not isinstance(value, list) or not all(isinstance(word, str) for word in value):
        raise invalid("bad_words must be a list of strings", param="bad_words")
    if len(value) > MAX_NUM_BAD_WORDS:
        raise invalid(
            f"bad_words holds {len(value)} words; at most {MAX_NUM_BAD_WORDS} are allowed",
            param="bad_words",
        )
    for i, word in enumerate(value):
        check_text(word, "bad_words")
        if len(word) > MAX_BAD_WORD_CHARS:
            raise invalid(
                f"bad_words[{i}] is {len(word)} characters; at most {MAX_BAD_WORD_CHARS} are "
                "allowed",
                param="bad_words",
            )
    try:
        sequences = bad_words_token_ids(tokenizer, value)
    except ValueError as error:  # a word that encodes to no token
        raise invalid(str(error), param="bad_words") from error
    num_tokens = sum(len(ids) for ids in sequences)
    if len(sequences) > MAX_NUM_BAD_WORDS or num_tokens > MAX_BAD_WORDS_TOTAL_TOKENS:
        raise invalid(
            f"bad_words encode to {len(sequences)} token sequences of {num_tokens} tokens in all; "
            f"at most {MAX_NUM_BAD_WORDS} sequences and {MAX_BAD_WORDS_TOTAL_TOKENS} tokens are "
            "allowed",
            param="bad_words",
        )
    for ids in sequences:
        for token_id in ids:
            if not 0 <= token_id < vocab_size:
                raise invalid(
                    f"bad_words encode to token id {token_id}, outside the vocabulary "
                    f"[0, {vocab_size})",
                    param="bad_words",
                )
    return sequences


def _token_id(key: Any, label: str, vocab_size: int) -> int:
    if isinstance(key, str) and _TOKEN_ID_KEY.fullmatch(key):
        # more digits than any vocabulary has ids is out of it (and int() refuses 4300+ digits)
        token_id = int(key) if len(key) <= _MAX_KEY_CHARS else -1
    elif _is_int(key):
        token_id = key
    else:
        raise invalid(f"{label} is not a token id: keys must be integers", param="logit_bias")
    if not 0 <= token_id < vocab_size:
        raise invalid(f"{label} is outside the vocabulary [0, {vocab_size})", param="logit_bias")
    return token_id


def _bias(value: Any, label: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"{label} must be a number, got {_kind(value)}", param="logit_bias")
    if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:  # also refuses NaN and infinities
        raise invalid(
            f"{label} must be in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value}",
            param="logit_bias",
        )
    return float(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_JSON_KINDS: dict[type, str] = {dict: "an object", list: "a list", str: "a string"}


def _kind(value: Any) -> str:
    return _JSON_KINDS.get(type(value), type(value).__name__)
