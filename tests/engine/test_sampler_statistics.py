"""Sampler, statistically: token counts from ~20k draws vs the exact distribution (numpy).

Each knob samples a fixed 16-token logits row many times (one big batch of the same row, over
several calls) and compares the counts with the distribution computed independently here,
with a chi-square test (reject at p < 1e-3), and checks that tokens of expected probability 0
never appear. The torch seed is fixed, so the outcome is deterministic. Negative controls show
the check does reject a wrong expected distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from engine.sampling import Sampler, SamplingParams, SamplingRow, make_generator

# Distinct logits, unsorted; at T=1 the top-6 mass is 0.80 and top-5 0.74 (top_p=0.75 keeps 6).
LOGITS = np.array(
    [0.8, -1.2, 2.0, 0.1, -0.4, 1.3, -2.2, 0.6, -0.9, 1.6, -1.8, 0.3, -0.2, 1.1, -1.5, -0.7]
)
VOCAB_SIZE = len(LOGITS)
NUM_DRAWS = 20_000
BATCH_SIZE = 4_000
ALPHA = 1e-3


@pytest.fixture(autouse=True)
def _fixed_seed() -> None:
    torch.manual_seed(2024)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def keep_renormalised(probs: np.ndarray, keep: np.ndarray) -> np.ndarray:
    kept = np.where(keep, probs, 0.0)
    return kept / kept.sum()


def draw_counts(
    params: SamplingParams,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    banned: Sequence[int] = (),
    seeded: bool = False,
) -> np.ndarray:
    """Counts per token of NUM_DRAWS samples of LOGITS under ``params``."""
    logits = torch.tensor(LOGITS, dtype=torch.float32).expand(BATCH_SIZE, VOCAB_SIZE)
    generators = [
        make_generator(i, torch.device("cpu")) if seeded else None for i in range(BATCH_SIZE)
    ]
    rows = [SamplingRow(params, list(prompt), list(output), g, list(banned)) for g in generators]
    counts = np.zeros(VOCAB_SIZE, dtype=np.int64)
    sampler = Sampler()
    for _ in range(NUM_DRAWS // BATCH_SIZE):
        counts += np.bincount(sampler(logits, rows).sampled_token_ids, minlength=VOCAB_SIZE)
    return counts


def chi_square_pvalue(counts: np.ndarray, expected: np.ndarray) -> float:
    positive = expected > 0
    f_exp = expected[positive] / expected[positive].sum() * counts.sum()
    return float(chisquare(counts[positive], f_exp).pvalue)


def assert_matches(counts: np.ndarray, expected: np.ndarray) -> None:
    assert np.all(counts[expected == 0] == 0), f"zero-probability tokens drawn: {counts}"
    assert expected[expected > 0].min() * counts.sum() >= 5, "chi-square needs 5+ per bin"
    pvalue = chi_square_pvalue(counts, expected)
    assert pvalue > ALPHA, f"p={pvalue:.2e}\ncounts={counts}\nexpected={expected * counts.sum()}"


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_temperature(temperature: float) -> None:
    counts = draw_counts(SamplingParams(temperature=temperature))
    assert_matches(counts, softmax(LOGITS / temperature))


def test_top_k() -> None:
    counts = draw_counts(SamplingParams(top_k=5, temperature=1.2))
    keep = np.sort(LOGITS)[-5] <= LOGITS
    assert keep.sum() == 5
    assert_matches(counts, keep_renormalised(softmax(LOGITS / 1.2), keep))


def expected_top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
    order = np.argsort(-probs)
    mass_before = np.cumsum(probs[order]) - probs[order]
    keep = np.zeros(len(probs), dtype=bool)
    keep[order] = mass_before < top_p  # the smallest top set whose mass reaches top_p
    return keep_renormalised(probs, keep)


def test_top_p() -> None:
    counts = draw_counts(SamplingParams(top_p=0.75))
    expected = expected_top_p(softmax(LOGITS), 0.75)
    assert (expected > 0).sum() == 6
    assert_matches(counts, expected)


def test_min_p() -> None:
    counts = draw_counts(SamplingParams(min_p=0.12))
    probs = softmax(LOGITS)
    expected = keep_renormalised(probs, probs >= 0.12 * probs.max())
    assert (expected > 0).sum() == 8
    assert_matches(counts, expected)


def test_penalties_with_temperature() -> None:
    prompt, output = [0, 3, 5, 2], [3, 3, 7, 9, 9, 9, 1]
    params = SamplingParams(
        temperature=0.9, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.25
    )
    counts = draw_counts(params, prompt, output)
    x = LOGITS.copy()
    for token in set(prompt + output):
        x[token] = x[token] / 1.3 if x[token] > 0 else x[token] * 1.3
    occurrences = np.bincount(output, minlength=VOCAB_SIZE)
    x -= 0.25 * occurrences + 0.4 * (occurrences > 0)
    assert_matches(counts, softmax(x / 0.9))


def test_all_knobs_with_bans_and_seeded_rows() -> None:
    """Order check: bans, then temperature, min_p, top_k, top_p; every row has its own seed."""
    params = SamplingParams(temperature=0.8, min_p=0.03, top_k=8, top_p=0.9)
    counts = draw_counts(params, banned=[2, 13], seeded=True)
    x = LOGITS.copy()
    x[[2, 13]] = -np.inf
    probs = softmax(x / 0.8)
    keep = (probs >= 0.03 * probs.max()) & (x >= np.sort(x)[-8])
    expected = expected_top_p(keep_renormalised(probs, keep), 0.9)
    assert 3 <= (expected > 0).sum() < 8
    assert_matches(counts, expected)


# Moderate biases, so that every token keeps enough mass for the chi-square test.
BIAS = {6: 3.0, 2: -1.5, 14: 1.2, 9: -0.6}
ALLOWED = [0, 3, 5, 6, 11, 14]


def biased(x: np.ndarray, bias: dict[int, float]) -> np.ndarray:
    x = x.copy()
    for token, value in bias.items():
        x[token] += value
    return x


@pytest.mark.parametrize(("temperature", "seeded"), [(1.0, False), (0.7, True)])
def test_logit_bias(temperature: float, seeded: bool) -> None:
    counts = draw_counts(SamplingParams(temperature=temperature, logit_bias=BIAS), seeded=seeded)
    assert_matches(counts, softmax(biased(LOGITS, BIAS) / temperature))


def test_allowed_token_ids_is_the_renormalised_distribution() -> None:
    """No other token in 20k draws, and the allowed ones in their renormalised proportions."""
    counts = draw_counts(SamplingParams(allowed_token_ids=ALLOWED), seeded=True)
    keep = np.isin(np.arange(VOCAB_SIZE), ALLOWED)
    assert_matches(counts, keep_renormalised(softmax(LOGITS), keep))


def test_allowed_and_bias_before_bans_penalties_and_top_k() -> None:
    """Order check: allowed mask, bias, bans, repetition penalty, temperature, top_k. Token 14
    (-1.5, biased +2, in the prompt) makes the top 4 at (-1.5 + 2) / 1.5 = 0.33; with the
    penalty before the bias it would read -1.5 * 1.5 + 2 = -0.25, and token 3 would instead."""
    bias = {**BIAS, 14: 2.0}
    params = SamplingParams(
        allowed_token_ids=ALLOWED,
        logit_bias=bias,
        repetition_penalty=1.5,
        temperature=0.8,
        top_k=4,
    )
    counts = draw_counts(params, prompt=[3, 14], banned=[11])
    x = np.where(np.isin(np.arange(VOCAB_SIZE), ALLOWED), LOGITS, -np.inf)
    x = biased(x, bias)
    x[11] = -np.inf
    x[[3, 14]] = np.where(x[[3, 14]] > 0, x[[3, 14]] / 1.5, x[[3, 14]] * 1.5)
    keep = x >= np.sort(x)[-4]
    assert keep.sum() == 4 and keep[14] and not keep[3]
    assert_matches(counts, keep_renormalised(softmax(x / 0.8), keep))


def test_negative_control_an_ignored_bias_is_rejected() -> None:
    counts = draw_counts(SamplingParams(logit_bias=BIAS))
    assert chi_square_pvalue(counts, softmax(LOGITS)) < ALPHA


def test_negative_control_wrong_temperature_is_rejected() -> None:
    counts = draw_counts(SamplingParams(temperature=1.0))
    assert chi_square_pvalue(counts, softmax(LOGITS / 0.7)) < ALPHA
    with pytest.raises(AssertionError):
        assert_matches(counts, softmax(LOGITS / 0.7))


def test_negative_control_zero_probability_tokens_are_caught() -> None:
    counts = draw_counts(SamplingParams())  # no top_p applied
    with pytest.raises(AssertionError, match="zero-probability"):
        assert_matches(counts, expected_top_p(softmax(LOGITS), 0.75))
