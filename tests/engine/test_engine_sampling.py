"""End to end: the engine's sampled first tokens follow the exact distribution of HF's logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from scipy.stats import chisquare

from engine import LLM, SamplingParams
from tests.engine.hf_reference import hf_log_softmax
from tests.engine.test_parity import make_prompts

NUM_SAMPLES = 4000


def _first_token_counts(llm: LLM, prompt: list[int], params: SamplingParams) -> np.ndarray:
    (out,) = llm.generate([prompt], params)
    counts = np.zeros(llm.engine.model_config.vocab_size)
    for completion in out.outputs:
        counts[completion.token_ids[0]] += 1
    return counts


def _expected(log_probs: torch.Tensor, temperature: float, top_k: int) -> np.ndarray:
    logits = log_probs.double() / temperature
    kept = torch.topk(logits, top_k).indices
    probs = torch.zeros_like(logits)
    probs[kept] = torch.softmax(logits[kept], dim=-1)
    return probs.numpy()


def test_n_samples_follow_temperature_top_k_distribution(llama_dir: Path) -> None:
    torch.manual_seed(0)
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", max_num_seqs=NUM_SAMPLES)
    prompt = make_prompts(seed=11)[3]
    params = SamplingParams(temperature=0.7, top_k=12, max_tokens=1, n=NUM_SAMPLES, seed=3)
    counts = _first_token_counts(llm, prompt, params)
    expected = _expected(hf_log_softmax(llama_dir, prompt)[-1], 0.7, 12)
    assert counts[expected == 0].sum() == 0  # nothing outside the top-k
    kept = expected > 0
    assert chisquare(counts[kept], expected[kept] * NUM_SAMPLES).pvalue > 1e-3
    # and a wrong temperature would have been caught
    wrong = _expected(hf_log_softmax(llama_dir, prompt)[-1], 1.4, 12)
    assert chisquare(counts[kept], wrong[kept] * NUM_SAMPLES).pvalue < 1e-3
