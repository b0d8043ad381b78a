"""Synthetic workloads: prompts of exact token lengths built from vocabulary tokens.

Prompts are random vocabulary token ids decoded to text, re-encoded and fixed up until the text
encodes to exactly the sampled length (as vLLM's random dataset does), all drawn from one
``random.Random(seed)``, so a seed gives the same requests every run and at every rate.

Workloads (lengths in tokens, counted without special tokens):

- ``fixed``: every prompt ``input_len``, every output ``output_len``.
- ``uniform``: input and output lengths uniform over ``input_range`` / ``output_range``.
- ``chat-like``: long-tailed, like chat traffic: lengths are lognormal with median
  ``input_len`` / ``output_len`` and ``input_sigma`` / ``output_sigma`` the standard deviation
  of the log length (1.0 puts the p90 at 3.6x the median), clipped to the ranges.
- ``shared-prefix``: ``num_prefixes`` system prompts of ``prefix_len`` tokens; each request
  takes one at random plus its own suffix of a length uniform over ``suffix_range`` and asks
  for ``output_len`` tokens. A request's encoding starts with its prefix's exact token ids.
- ``multi-turn``: ``num_conversations`` chats of ``num_turns`` turns sharing one system prompt
  of ``system_prompt_len`` tokens; each turn adds user tokens (``user_range``) and asks for a
  reply (``reply_range``), and sends the whole conversation so far as token ids. Its later
  prompts hold the server's replies, so it is built as conversations (``conversations``) and
  run turn by turn (``conversation_runner``), not as requests.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

from bench.serving.tokens import TokenCodec

WorkloadKind = Literal["fixed", "uniform", "chat-like", "shared-prefix", "multi-turn"]
WORKLOAD_KINDS: tuple[WorkloadKind, ...] = (
    "fixed", "uniform", "chat-like", "shared-prefix", "multi-turn",
)  # fmt: skip
_MAX_FIXUPS = 64  # decode / re-encode rounds before a prompt's length is taken as it is


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    kind: WorkloadKind = "fixed"
    input_len: int = 128  # fixed prompt length; the median for chat-like
    output_len: int = 128  # fixed output length; the median for chat-like and shared-prefix's
    input_range: tuple[int, int] = (32, 1024)  # uniform bounds; chat-like clip (inclusive)
    output_range: tuple[int, int] = (16, 512)  # uniform bounds; chat-like clip (inclusive)
    input_sigma: float = 1.0  # chat-like: std-dev of ln(input length)
    output_sigma: float = 0.8  # chat-like: std-dev of ln(output length)
    num_prefixes: int = 4  # shared-prefix: distinct system prompts
    prefix_len: int = 256  # shared-prefix: tokens per system prompt
    suffix_range: tuple[int, int] = (16, 64)  # shared-prefix: per-request suffix tokens
    num_conversations: int = 64  # multi-turn: conversations (they arrive at the request rate)
    num_turns: int = 6  # multi-turn: turns per conversation
    system_prompt_len: int = 1000  # multi-turn: tokens of the system prompt all of them share
    user_range: tuple[int, int] = (50, 200)  # multi-turn: new user tokens per turn (inclusive)
    reply_range: tuple[int, int] = (100, 200)  # multi-turn: reply tokens per turn (inclusive)

    def __post_init__(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise ValueError(f"unknown workload {self.kind!r}; choose from {WORKLOAD_KINDS}")
        for name in ("input_range", "output_range", "suffix_range", "user_range", "reply_range"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"{name} must be 0 <= min <= max, got {(low, high)}")
        if min(self.input_len, self.prefix_len, self.system_prompt_len) < 0:
            raise ValueError("lengths must be >= 0")
        if min(self.num_prefixes, self.num_conversations, self.num_turns) < 1:
            raise ValueError("num_prefixes, num_conversations and num_turns must be >= 1")
        if min(self.output_len, self.output_range[0], self.reply_range[0]) < 1:
            raise ValueError("output lengths must be >= 1")
        if self.system_prompt_len + self.user_range[0] < 1:
            raise ValueError("a multi-turn first prompt needs at least one token")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    index: int  # position in the workload (and in arrival order)
    prompt: str  # the text sent (completions: the prompt; chat: the one user message)
    prompt_len: int  # tokens the prompt encodes to (without special tokens)
    output_len: int  # tokens asked for (max_tokens, with ignore_eos)
    prefix_id: int | None = None  # shared-prefix: which system prompt it starts with
    # sent as the prompt instead of the text when set (completions only; multi-turn)
    prompt_token_ids: tuple[int, ...] | None = None
    conversation_id: int | None = None  # multi-turn: the conversation it is a turn of
    turn_index: int | None = None  # multi-turn: its turn (0 first)


def build_requests(
    spec: WorkloadSpec, codec: TokenCodec, num_requests: int, seed: int
) -> list[BenchRequest]:
    """``num_requests`` requests of ``spec``, the same for the same seed. A multi-turn workload
    is built with ``conversations.build_conversations`` instead (ValueError here)."""
    if spec.kind == "multi-turn":
        raise ValueError(
            "a multi-turn workload's later prompts hold the server's replies: build it with "
            "bench.serving.conversations.build_conversations"
        )
    rng = random.Random(seed)
    if spec.kind == "shared-prefix":
        return _shared_prefix_requests(spec, codec, num_requests, rng)
    requests = []
    for index in range(num_requests):
        input_len, output_len = _sample_lengths(spec, rng)
        prompt, token_ids = exact_length_text(codec, rng, input_len)
        requests.append(BenchRequest(index, prompt, len(token_ids), output_len))
    return requests


def _sample_lengths(spec: WorkloadSpec, rng: random.Random) -> tuple[int, int]:
    if spec.kind == "uniform":
        return rng.randint(*spec.input_range), rng.randint(*spec.output_range)
    if spec.kind == "chat-like":
        return (
            _lognormal(rng, spec.input_len, spec.input_sigma, spec.input_range),
            _lognormal(rng, spec.output_len, spec.output_sigma, spec.output_range),
        )
    return spec.input_len, spec.output_len


def _lognormal(rng: random.Random, median: int, sigma: float, bounds: tuple[int, int]) -> int:
    value = round(rng.lognormvariate(math.log(max(median, 1)), sigma))
    return min(max(value, bounds[0]), bounds[1])


def _shared_prefix_requests(
    spec: WorkloadSpec, codec: TokenCodec, num_requests: int, rng: random.Random
) -> list[BenchRequest]:
    prefixes = [exact_length_text(codec, rng, spec.prefix_len) for _ in range(spec.num_prefixes)]
    requests = []
    for index in range(num_requests):
        prefix_id = rng.randrange(spec.num_prefixes)
        prefix_text, prefix_ids = prefixes[prefix_id]
        suffix_len = rng.randint(*spec.suffix_range)
        prompt, token_ids = exact_length_text(codec, rng, suffix_len, prefix_text, prefix_ids)
        requests.append(BenchRequest(index, prompt, len(token_ids), spec.output_len, prefix_id))
    return requests


def exact_length_text(
    codec: TokenCodec,
    rng: random.Random,
    num_tokens: int,
    prefix_text: str = "",
    prefix_ids: list[int] | None = None,
) -> tuple[str, list[int]]:
    """Text that encodes to ``prefix_ids`` followed by ``num_tokens`` random tokens.

    Decoding random ids and encoding the text again can merge or split tokens (and break the
    prefix at the seam), so drawn tokens are dropped from the end or fresh ones appended until
    the text round-trips to the length. Returns the text and its token ids; after
    ``_MAX_FIXUPS`` rounds the last text is taken as it is (the request records its length).
    """
    prefix_ids = prefix_ids or []
    num_prefix = len(prefix_ids)
    tail = rng.choices(codec.sampleable_token_ids, k=num_tokens)
    text, token_ids = prefix_text, list(prefix_ids)
    for _ in range(_MAX_FIXUPS):
        text = prefix_text + codec.decode(tail)
        token_ids = codec.encode(text)
        if token_ids[:num_prefix] != prefix_ids:  # the seam merged: draw the tail afresh
            tail = rng.choices(codec.sampleable_token_ids, k=num_tokens)
            continue
        excess = len(token_ids) - num_prefix - num_tokens
        if excess == 0:
            return text, token_ids
        if excess > 0:
            tail = tail[: max(len(tail) - excess, 0)]
        else:
            tail = tail + rng.choices(codec.sampleable_token_ids, k=-excess)
    return text, token_ids
