"""The model-execution core shared by every pdserve worker.

Importing ``engine`` is cheap; the torch-backed pieces load on first use, so pure-CPU parts
(the scheduler, the block allocator) stay importable without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine, StepResult
    from engine.messages import GenerateRequest, OutputBatch, TokenEvent
    from engine.outputs import CompletionOutput, Logprob, RequestOutput
    from engine.sampling.params import SamplingParams
    from engine.structured.spec import StructuredOutputsParams, StructuredOutputSpec

_EXPORTS = {
    "BeamSearchOutput": "engine.beam_search",
    "BeamSearchParams": "engine.beam_search",
    "BeamSearchSequence": "engine.beam_search",
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "StepResult": "engine.llm_engine",
    "GenerateRequest": "engine.messages",
    "OutputBatch": "engine.messages",
    "TokenEvent": "engine.messages",
    "CompletionOutput": "engine.outputs",
    "Logprob": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling.params",
    "StructuredOutputSpec": "engine.structured.spec",
    "StructuredOutputsParams": "engine.structured.spec",
}

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StepResult",
    "StructuredOutputSpec",
    "StructuredOutputsParams",
    "TokenEvent",
    "GenerateRequest",
    "OutputBatch",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
