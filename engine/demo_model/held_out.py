"""The demo model's held-out docstrings (the windows its trainer evaluates on) and an engine's
perplexity over them, from its prompt logprobs."""

from __future__ import annotations

import math

from engine.demo_model import DEMO_MODEL_DIR
from engine.llm import LLM
from engine.sampling import SamplingParams


def held_out_windows() -> list[list[int]]:
    """The held-out documents' token windows, as engine/demo_model/train.py cuts them."""
    from transformers import PreTrainedTokenizerFast

    from engine.demo_model.corpus import corpus_documents
    from engine.demo_model.train import split_documents, to_windows

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(DEMO_MODEL_DIR))
    windows, _ = to_windows(tokenizer, split_documents(corpus_documents())[1])
    return [window.tolist() for window in windows]


def held_out_perplexity(llm: LLM, windows: list[list[int]]) -> float:
    """exp of the mean negative log-likelihood of every window's tokens after its first."""
    outputs = llm.generate(windows, SamplingParams(max_tokens=1, prompt_logprobs=0))
    total, count = 0.0, 0
    for window, output in zip(windows, outputs):
        assert output.prompt_logprobs is not None
        for token, logprobs in zip(window[1:], output.prompt_logprobs[1:]):
            assert logprobs is not None
            total -= logprobs[token].logprob
            count += 1
    return math.exp(total / count)
