"""Where the sampler's randomness comes from: per-request generators and the exact draw.

A row with ``SamplingParams.seed`` owns a ``torch.Generator`` (``make_generator``) and each
step consumes exactly one exponential draw of size [V] from it, whatever else is in the batch,
so a seeded request yields the same tokens alone or batched. Rows without a seed share one
batched draw from the device's global RNG. ``derive_seed`` gives each of a request's ``n``
parallel samples its own seed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.host_to_device import to_device
from engine.sampling.seeds import MASK64


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed`` (any int; reduced modulo 2**64).

    A CPU generator (mt19937) keeps only the low 32 bits of its seed, so there the two halves
    are folded together first: seeds that differ only above bit 32 (as ``derive_seed``'s
    63-bit sample seeds mostly do) gave identical streams. Seeds below 2**32 are unchanged.
    """
    seed &= MASK64
    if torch.device(device).type == "cpu":
        seed = (seed ^ (seed >> 32)) & 0xFFFFFFFF
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def sample_from_probs(
    probs: torch.Tensor, generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """One token per row of ``probs`` [B, V], drawn exactly from that row's distribution.

    Uses the exponential race: with q_i ~ Exp(1) i.i.d., argmax_i p_i / q_i is distributed as
    Categorical(p). Consumes ``probs``. Returns token ids [B] (int64, on ``probs.device``).
    """
    vocab_size = probs.shape[1]
    q = torch.empty_like(probs)  # [B, V]
    seeded = [(row, gen) for row, gen in enumerate(generators) if gen is not None]
    if not seeded:
        q.exponential_()
    else:
        unseeded = [row for row, gen in enumerate(generators) if gen is None]
        if unseeded:
            shared = torch.empty((len(unseeded), vocab_size), device=probs.device).exponential_()
            q[to_device(unseeded, torch.long, probs.device)] = shared
        for row, gen in seeded:
            q[row].exponential_(generator=gen)
    # Exp(1) can round to 0; a tiny floor keeps p / q finite (and 0 / q == 0 for banned tokens).
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)


def advance_generator(generator: torch.Generator, num_draws: int, vocab_size: int) -> None:
    """Consume what ``num_draws`` sampled tokens took from a seeded row's generator.

    A request resumed on another worker replays its generator this way, so its stream goes on
    exactly where it stopped (one exponential draw of size [V] per sampled token).
    """
    scratch = torch.empty(vocab_size, device=generator.device)
    for _ in range(num_draws):
        scratch.exponential_(generator=generator)
