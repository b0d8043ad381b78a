"""A short profile of an engine's step times at start-up (``pdserve serve --latency-profile``).

The router's latency model (router/latency_model.py) fits each worker's step time from the
steps it reports; before any traffic it has none. This runs a few synthetic requests through the
worker's engine loop, as served requests run (``run_latency_profile_in_loop``: each step timed
as the loop's turn, outputs included), so that their steps go in the worker's first load
report: prompts alone, of a few sizes up to the step budget (prompt steps of different sizes),
then batches of prompts decoding together (decode steps of different batch sizes, over short
and longer contexts). The prompts are random token ids under a cache salt of their own, so no
request's prefix ever matches theirs; their blocks stay cached until evicted, like any finished
request's.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.messages import GenerateRequest
from engine.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.engine_loop import EngineLoop
    from engine.llm_engine import LLMEngine

PROFILE_SALT = "pdserve-latency-profile"
PROFILE_GATEWAY = "latency-profile"  # the output stream the profile's requests go to
_DECODE_PROMPT_TOKENS = 16
_DECODE_STEPS = 8  # a decode batch's steps at start-up (pdserve profile runs longer ones)
_BATCH_SIZES = (1, 4, 16)


@dataclass(frozen=True, slots=True)
class ProfileRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)


def profile_batches(
    engine: LLMEngine,
    seed: int = 0,
    batch_sizes: tuple[int, ...] = _BATCH_SIZES,
    decode_steps: int = _DECODE_STEPS,
) -> list[list[ProfileRequest]]:
    """The profile's requests, in batches run one after another (each batch's requests
    together): prompts alone, of a few sizes up to the step budget, one token each; then batches
    of ``batch_sizes`` prompts of a short and of a longer context, decoding together for
    ``decode_steps`` steps (a batch's first few steps are slower than its later ones: on a CPU,
    by about 10 % over the first four of 32)."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    config = engine.scheduler.config
    capacity = engine.block_manager.pool.num_blocks * engine.block_manager.block_size
    longest = max(1, min(config.max_num_batched_tokens, engine.max_model_len - 2, capacity // 2))
    prompt_sizes = sorted({max(1, longest // 8), max(1, longest // 4), longest // 2, longest})

    def prompt(size: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(size)]

    batches = [
        [ProfileRequest(f"latency-profile-{seed}-{size}", prompt(size), 1)] for size in prompt_sizes
    ]
    # decode batches of short and of longer contexts: rows and KV read vary apart
    for context in sorted({_DECODE_PROMPT_TOKENS, max(_DECODE_PROMPT_TOKENS, longest // 2)}):
        per_request = context + decode_steps
        for size in batch_sizes:
            size = min(size, config.max_num_seqs, capacity // (2 * per_request))
            if size < 1 or per_request >= engine.max_model_len:
                continue
            name = f"latency-profile-{seed}-{context}x{size}"
            batches.append(
                [ProfileRequest(f"{name}-{i}", prompt(context), decode_steps) for i in range(size)]
            )
    return batches


def run_latency_profile_in_loop(
    loop: EngineLoop,
    seed: int = 0,
    batch_sizes: tuple[int, ...] = _BATCH_SIZES,
    timeout_s: float = 600.0,
    decode_steps: int = _DECODE_STEPS,
) -> int:
    """Run the profile's requests through a worker's engine loop, as served requests run (their
    steps timed as the loop's turns, outputs included); returns the steps it ran. Raises
    TimeoutError if they have not all ended within ``timeout_s``."""
    steps_before = loop.engine.stats.num_steps
    deadline = time.monotonic() + timeout_s
    for batch in profile_batches(loop.engine, seed, batch_sizes, decode_steps):
        unfinished = {request.request_id for request in batch}
        for request in batch:
            loop.submit(
                GenerateRequest(
                    request.request_id,
                    request.prompt_token_ids,
                    request.params,
                    PROFILE_GATEWAY,
                    PROFILE_SALT,
                )
            )
        while unfinished:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise TimeoutError(f"the latency profile did not end within {timeout_s:g} s")
            outputs = loop.next_batch(PROFILE_GATEWAY, min(left_s, 1.0))
            for event in () if outputs is None else outputs.events:
                if event.finish_reason is not None:
                    unfinished.discard(event.request_id)
    return loop.engine.stats.num_steps - steps_before
