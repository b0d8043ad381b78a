"""Reference outputs from Hugging Face transformers on the same weights (float32, CPU)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


@cache
def hf_model(model_dir: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval()


def hf_greedy(
    model_dir: Path,
    prompt: list[int],
    max_new_tokens: int,
    bad_words_ids: list[list[int]] | None = None,
) -> list[int]:
    """Greedy continuation by ``generate`` (never completing one of ``bad_words_ids``); stops
    after eos like the engine does."""
    model = hf_model(model_dir)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            bad_words_ids=bad_words_ids,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def hf_log_softmax(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] log-probabilities of the next token at every position."""
    model = hf_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)
