"""A short profile of an engine's step times at start-up (``pdserve serve --latency-profile``).

The router's latency model (router/latency_model.py) fits each worker's step time from the
steps it reports; before any traffic it has none. This runs a few synthetic requests through the
engine's own path, so that their steps, recorded like any others, go in the worker's first load
report: prompts alone, of a few sizes up to the step budget (prompt steps of different sizes),
then batches of prompts decoding together (decode steps of different batch sizes, over short
and longer contexts). The prompts are random token ids under a cache salt of their own, so no
request's prefix ever matches theirs; their blocks stay cached until evicted, like any finished
request's.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from engine.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

PROFILE_SALT = "pdserve-latency-profile"
_DECODE_PROMPT_TOKENS = 16
_DECODE_STEPS = 8
_BATCH_SIZES = (1, 4, 16)


def run_latency_profile(
    engine: LLMEngine, seed: int = 0, batch_sizes: tuple[int, ...] = _BATCH_SIZES
) -> int:
    """Run the profile's requests to their end on ``engine`` (the caller holds it: no other
    request may be in flight), decoding in batches of ``batch_sizes``; returns the steps it
    ran."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    config = engine.scheduler.config
    capacity = engine.block_manager.pool.num_blocks * engine.block_manager.block_size
    longest = max(1, min(config.max_num_batched_tokens, engine.max_model_len - 2, capacity // 2))
    prompt_sizes = sorted({max(1, longest // 8), max(1, longest // 4), longest // 2, longest})
    jobs: list[tuple[list[int], int]] = [(prompt_sizes, 1)]  # alone, one token each
    # decode batches of short and of longer contexts: rows and KV read vary apart
    for context in sorted({_DECODE_PROMPT_TOKENS, max(_DECODE_PROMPT_TOKENS, longest // 2)}):
        per_request = context + _DECODE_STEPS
        for batch in batch_sizes:
            batch = min(batch, config.max_num_seqs, capacity // (2 * per_request))
            if batch >= 1 and per_request < engine.max_model_len:
                jobs.append(([context] * batch, _DECODE_STEPS))
    steps = 0
    for number, (sizes, max_tokens) in enumerate(jobs):
        if sizes is prompt_sizes:  # one at a time: each its own prompt steps
            for size in sizes:
                _add(engine, f"latency-profile-{number}-{size}", rng, vocab, size, max_tokens)
                steps += _run_to_end(engine)
            continue
        for index, size in enumerate(sizes):
            _add(engine, f"latency-profile-{number}-{index}", rng, vocab, size, max_tokens)
        steps += _run_to_end(engine)
    return steps


def _add(
    engine: LLMEngine, request_id: str, rng: random.Random, vocab: int, size: int, max_tokens: int
) -> None:
    prompt = [rng.randrange(vocab) for _ in range(size)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(request_id, prompt, params, cache_salt=PROFILE_SALT)


def _run_to_end(engine: LLMEngine) -> int:
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps
