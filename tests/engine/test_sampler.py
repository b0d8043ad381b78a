"""Sampler, deterministic parts: greedy, penalties and processors vs numpy, logprobs, bans, seeds.

The distribution of sampled tokens is checked statistically in test_sampler_statistics.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from engine.request_state import position_logprobs
from engine.sampling import (
    Sampler,
    SamplingParams,
    SamplingRow,
    derive_seed,
    make_generator,
)
from engine.sampling.logprobs import compute_logprobs
from engine.sampling.penalties import apply_penalties
from engine.sampling.processors import apply_top_k, sampling_probs

CPU = torch.device("cpu")


def row(
    params: SamplingParams,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    banned: Sequence[int] = (),
) -> SamplingRow:
    generator = None if params.seed is None else make_generator(params.seed, CPU)
    return SamplingRow(params, list(prompt), list(output), generator, list(banned))


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def np_penalise(x: np.ndarray, params: SamplingParams, prompt: list[int], output: list[int]):
    """Hand-written reference: HF repetition rule over prompt+output, then presence/frequency."""
    x = x.astype(np.float64).copy()
    rp = params.repetition_penalty
    for token in set(prompt) | set(output):
        x[token] = x[token] / rp if x[token] > 0 else x[token] * rp
    counts = np.bincount(np.array(output, dtype=np.int64), minlength=x.shape[0])
    return x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


@pytest.fixture(autouse=True)
def _fixed_seed() -> None:
    torch.manual_seed(1234)


def test_all_greedy_is_argmax() -> None:
    logits = torch.randn(8, 100)
    out = Sampler()(logits, [row(SamplingParams(temperature=0.0)) for _ in range(8)])
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8


def test_greedy_rows_stay_argmax_in_a_mixed_batch() -> None:
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.3, top_k=1)] * 3
    out = Sampler()(logits, [row(p) for p in params])
    assert out.sampled_token_ids == logits.argmax(-1).tolist()


def test_input_logits_are_not_modified() -> None:
    logits = torch.randn(2, 30)
    before = logits.clone()
    params = SamplingParams(temperature=0.5, top_p=0.5, min_p=0.1, repetition_penalty=1.5)
    Sampler()(logits, [row(params, [1, 2], [3], banned=[4]), row(SamplingParams(top_k=3))])
    assert torch.equal(logits, before)


def test_penalties_match_numpy_reference() -> None:
    vocab_size = 32
    logits = torch.randn(4, vocab_size) * 3
    cases = [
        (SamplingParams(repetition_penalty=1.7), [1, 2, 2, 30], [5, 1, 31]),
        (SamplingParams(presence_penalty=0.6, frequency_penalty=-0.4), [0, 4], [4, 4, 9, 9, 9, 11]),
        (SamplingParams(), [1, 2, 3], [4, 5]),  # no penalty: untouched
        (
            SamplingParams(repetition_penalty=0.8, presence_penalty=-1.5, frequency_penalty=2.0),
            [7, 8],
            [8, 8, 13],
        ),
    ]
    out = apply_penalties(logits, [row(p, prompt, output) for p, prompt, output in cases])
    for i, (params, prompt, output) in enumerate(cases):
        expected = np_penalise(logits[i].numpy(), params, prompt, output)
        np.testing.assert_allclose(out[i].numpy(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[2], logits[2])


def test_greedy_sees_penalties_and_bans() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, -1.0]] * 3)
    rows = [
        row(SamplingParams(temperature=0, presence_penalty=2.0), output=[0]),  # 5-2 < 4
        row(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[0, 1]),  # 2.5, 2, 3
        row(SamplingParams(temperature=0), banned=[0, 1]),
    ]
    assert Sampler()(logits, rows).sampled_token_ids == [1, 2, 2]


def test_banned_tokens_are_never_sampled() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, -5.0, -9.0]]).repeat(4096, 1)
    rows = [row(SamplingParams(temperature=2.0), banned=[0, 1, 2])] * 4096
    counts = np.bincount(Sampler()(logits, rows).sampled_token_ids, minlength=5)
    assert counts[:3].sum() == 0 and counts[3] > counts[4] > 0


def test_processors_match_numpy_reference() -> None:
    logits = torch.randn(5, 40) * 2
    cases = [
        SamplingParams(temperature=0.6),
        SamplingParams(top_k=7),
        SamplingParams(top_p=0.6, temperature=1.4),
        SamplingParams(min_p=0.2, temperature=0.8),
        SamplingParams(top_k=10, top_p=0.7, min_p=0.05, temperature=0.9),
    ]
    probs = sampling_probs(logits, cases)
    for i, params in enumerate(cases):
        expected = np_processed_probs(logits[i].numpy(), params)
        np.testing.assert_allclose(probs[i].numpy(), expected, atol=1e-6)
        assert np.array_equal(probs[i].numpy() > 0, expected > 0)


def np_processed_probs(x: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Reference: temperature, min_p, top_k, top_p on one row, in float64."""
    x = x.astype(np.float64) / params.temperature
    probs = np.exp(np_log_softmax(x))
    keep = probs >= params.min_p * probs.max()
    if params.top_k > 0:
        keep &= x >= np.sort(x)[::-1][params.top_k - 1]
    probs = np.where(keep, probs, 0.0) / np.where(keep, probs, 0.0).sum()
    order = np.argsort(-probs, kind="stable")
    mass_before = np.cumsum(probs[order]) - probs[order]
    keep = np.zeros_like(keep)
    keep[order] = (mass_before < params.top_p) & (probs[order] > 0)
    return np.where(keep, probs, 0.0) / np.where(keep, probs, 0.0).sum()


def test_top_p_keeps_the_smallest_set_even_through_a_tie() -> None:
    """Two tokens tie at 0.40 each and top_p is 0.3: one of them is enough (both were kept,
    so the set was larger than top_p asks; Hugging Face and vLLM keep one)."""
    logits = torch.tensor([[1.0, 1.0, 0.0, -1.0]])
    probs = sampling_probs(logits, [SamplingParams(top_p=0.3)])
    assert (probs > 0).sum().item() == 1
    assert probs[0, :2].max().item() == 1.0


def test_top_p_reached_exactly_keeps_no_more() -> None:
    """0.6 + 0.4 with top_p = 0.6: the first token's mass reaches p, so it alone is kept (1 - p
    taken in float32 was 0.39999998, below the second token's mass, which then stayed)."""
    logits = torch.tensor([[0.6, 0.4]]).log()
    probs = sampling_probs(logits, [SamplingParams(top_p=0.6)])
    assert probs.tolist() == [[1.0, 0.0]]


@pytest.mark.parametrize("top_k", [3, 2000])
def test_top_k_alone_with_and_without_sort(top_k: int) -> None:
    vocab_size = 3000
    logits = torch.randn(3, vocab_size)
    out = apply_top_k(logits, [top_k, vocab_size, 1])
    kept = torch.isfinite(out)
    assert kept.sum(-1).tolist() == [top_k, vocab_size, 1]
    assert torch.equal(out[kept], logits[kept])
    assert torch.equal(kept[0], logits[0] >= logits[0].topk(top_k).values[-1])


def test_logprobs_are_raw_with_rank_and_sorted_top_n() -> None:
    logits = torch.randn(4, 40) * 2
    cases = [
        SamplingParams(logprobs=5, temperature=0.3, repetition_penalty=1.9),
        SamplingParams(),
        SamplingParams(logprobs=0, top_k=10),
        SamplingParams(logprobs=20, temperature=0, presence_penalty=2.0),
    ]
    out = Sampler()(logits, [row(p, [0, 1, 2], [3, 4]) for p in cases])
    reference = np_log_softmax(logits.numpy())
    assert out.logprobs[1] is None
    for i in (0, 2, 3):
        result = out.logprobs[i]
        assert result is not None
        token = out.sampled_token_ids[i]
        assert result.sampled_token_id == token
        assert result.sampled_logprob == pytest.approx(reference[i, token], abs=1e-5)
        assert result.sampled_rank == 1 + int((reference[i] > reference[i, token]).sum())
        num_top = cases[i].logprobs or 0
        assert len(result.top_token_ids) == len(result.top_logprobs) == num_top
        assert list(result.top_token_ids) == list(np.argsort(-reference[i])[:num_top])
        np.testing.assert_allclose(
            result.top_logprobs, np.sort(reference[i])[::-1][:num_top], atol=1e-5
        )


def test_logprobs_n_larger_than_vocab() -> None:
    out = Sampler()(torch.randn(1, 6), [row(SamplingParams(logprobs=20, temperature=0))])
    result = out.logprobs[0]
    assert result is not None and result.sampled_rank == 1
    assert len(result.top_token_ids) == 6 and result.top_token_ids[0] == result.sampled_token_id


def test_unseeded_sampling_follows_the_global_seed() -> None:
    logits = torch.randn(16, 500)
    rows = [row(SamplingParams(temperature=1.0))] * 16
    torch.manual_seed(7)
    first = Sampler()(logits, rows).sampled_token_ids
    torch.manual_seed(7)
    assert Sampler()(logits, rows).sampled_token_ids == first


def run_seeded(seed: int, position: int, others: list[SamplingParams], steps: int) -> list[int]:
    """Tokens of a seeded row over ``steps`` steps, placed at ``position`` among ``others``."""
    params = SamplingParams(seed=seed, temperature=0.9, top_p=0.95)
    target = row(params)  # one generator for the whole sequence
    step_logits = torch.Generator().manual_seed(99)
    for _ in range(steps):
        own = torch.randn(1, 1000, generator=step_logits)  # the same per step in every run
        rows = [row(p) for p in others]
        rows.insert(position, target)
        logits = torch.randn(len(rows), 1000)
        logits[position] = own
        out = Sampler()(logits, rows)
        target.output_token_ids = [*target.output_token_ids, out.sampled_token_ids[position]]
    return list(target.output_token_ids)


def test_seeded_row_ignores_batch_composition_and_position() -> None:
    alone = run_seeded(seed=42, position=0, others=[], steps=12)
    torch.manual_seed(5)  # a different global RNG state must not matter either
    others = [SamplingParams(), SamplingParams(seed=3, top_k=5), SamplingParams(temperature=0)]
    batched = run_seeded(seed=42, position=2, others=others, steps=12)
    at_end = run_seeded(seed=42, position=5, others=others + others[:2], steps=12)
    assert alone == batched == at_end
    assert run_seeded(seed=43, position=0, others=[], steps=12) != alone


def test_derive_seed() -> None:
    assert derive_seed(1234, 0) == 1234
    derived = [derive_seed(1234, i) for i in range(1, 200)]
    assert len(set(derived)) == len(derived)
    assert all(0 <= s < 2**63 for s in derived)
    assert derive_seed(1234, 1) == derive_seed(1234, 1) != derive_seed(1235, 1)
    with pytest.raises(ValueError):
        derive_seed(1, -1)


def test_make_generator_accepts_any_int_seed() -> None:
    for seed in (0, -1, 2**64 + 5, -(2**70)):
        a = torch.rand(4, generator=make_generator(seed, CPU))
        assert torch.equal(a, torch.rand(4, generator=make_generator(seed, CPU)))


def test_shape_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.randn(3, 10), [row(SamplingParams())])


def test_cpu_seeds_that_differ_only_above_32_bits_draw_differently() -> None:
    """A CPU generator keeps 32 bits of its seed: 7 and 7 + 2**32 (and most pairs of
    ``derive_seed``'s 63-bit sample seeds) drew the same stream. Seeds below 2**32 draw as
    plain ``manual_seed`` does."""

    def draws(generator: torch.Generator) -> list[float]:
        return torch.rand(4, generator=generator).tolist()

    cpu = torch.device("cpu")
    assert draws(make_generator(7, cpu)) != draws(make_generator(7 + 2**32, cpu))
    assert draws(make_generator(7, cpu)) == draws(torch.Generator().manual_seed(7))
    siblings = [make_generator(derive_seed(0, i), cpu) for i in range(1, 200)]
    assert len({tuple(draws(g)) for g in siblings}) == len(siblings)


def test_tied_tokens_share_a_rank_in_the_offline_logprobs() -> None:
    """Logits [1, 2, 2, 0] and token 2 sampled: tokens 1 and 2 tie for first. Every API reads
    the same rank for token 2 (the offline dict ranked it 2 by its place in the top list,
    while ``sampled_rank`` and gRPC said 1)."""
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    rows = [row(SamplingParams(logprobs=4, temperature=0))]
    logprobs = compute_logprobs(logits, rows, torch.tensor([2]))[0]
    assert logprobs is not None and logprobs.sampled_rank == 1
    by_token = position_logprobs(logprobs)
    assert {token: lp.rank for token, lp in by_token.items()} == {1: 1, 2: 1, 0: 3, 3: 4}
