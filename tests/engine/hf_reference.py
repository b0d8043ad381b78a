"""Reference outputs from Hugging Face transformers on the same weights (float32, CPU)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

NEAR_TIE = 1e-3  # top-2 logit gap under which a float summation order may pick either token


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
    out = _generate(hf_model(model_dir), prompt, max_new_tokens, bad_words_ids=bad_words_ids)
    return [int(t) for t in out[0, len(prompt) :]]


def _generate(model: Any, prompt: list[int], max_new_tokens: int, **options: Any) -> Any:
    """``model.generate`` of one prompt without sampling (``options`` besides)."""
    with torch.no_grad():
        return model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **options,
        )


def hf_beams(
    model_dir: Path,
    prompt: list[int],
    width: int,
    max_new_tokens: int,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
) -> tuple[list[list[int]], list[float] | None]:
    """transformers' beams (generated tokens, cut after eos) and their scores, best first (no
    scores for one beam: transformers then decodes greedily)."""
    model = hf_model(model_dir)
    eos = model.generation_config.eos_token_id
    out = _generate(
        model,
        prompt,
        max_new_tokens,
        num_beams=width,
        num_return_sequences=width,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        output_scores=True,
        return_dict_in_generate=True,
    )
    beams = []
    for row in out.sequences[:, len(prompt) :].tolist():
        beams.append(row[: row.index(eos) + 1] if eos in row else row)
    scores = getattr(out, "sequences_scores", None)
    return beams, None if scores is None else scores.tolist()


def hf_log_softmax(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] log-probabilities of the next token at every position."""
    model = hf_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def first_divergence_near_ties(
    model_dir: Path, prompts: list[list[int]], got: list[list[int]], expected: list[list[int]]
) -> list[tuple[int, int, float]]:
    """(prompt, position, top-2 gap) of each sample that differs from transformers; asserts
    that each differs first at a near-tie, with one of the two tied tokens."""
    near_ties = []
    for index, (prompt, tokens, reference_tokens) in enumerate(zip(prompts, got, expected)):
        if tokens == reference_tokens:
            continue
        position = next(
            (i for i, (a, b) in enumerate(zip(tokens, reference_tokens)) if a != b),
            min(len(tokens), len(reference_tokens)),
        )
        assert position < min(len(tokens), len(reference_tokens)), (index, tokens)
        context = prompt + reference_tokens[:position]
        with torch.no_grad():
            logits = hf_model(model_dir)(torch.tensor([context])).logits[0, -1].float()
        top2 = torch.topk(logits, 2)
        gap = float(top2.values[0] - top2.values[1])
        assert gap < NEAR_TIE, f"prompt {index} differs at {position} where the gap is {gap}"
        assert tokens[position] in top2.indices.tolist()
        near_ties.append((index, position, gap))
    return near_ties
