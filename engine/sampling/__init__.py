"""Sampling: the user-facing ``SamplingParams`` and the batched ``Sampler`` behind it.

Imports are lazy so that pure-CPU users (the scheduler) can use the params and seeds without
pulling in torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.sampling.messages import (
        PromptTokenLogprobs,
        SamplerOutput,
        SamplingRow,
        TokenLogprobs,
    )
    from engine.sampling.params import SamplingParams
    from engine.sampling.rng import make_generator
    from engine.sampling.sampler import Sampler
    from engine.sampling.seeds import derive_seed

_EXPORTS = {
    "PromptTokenLogprobs": "engine.sampling.messages",
    "Sampler": "engine.sampling.sampler",
    "SamplerOutput": "engine.sampling.messages",
    "SamplingParams": "engine.sampling.params",
    "SamplingRow": "engine.sampling.messages",
    "TokenLogprobs": "engine.sampling.messages",
    "derive_seed": "engine.sampling.seeds",
    "make_generator": "engine.sampling.rng",
}

__all__ = [
    "PromptTokenLogprobs",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "SamplingRow",
    "TokenLogprobs",
    "derive_seed",
    "make_generator",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine.sampling' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
