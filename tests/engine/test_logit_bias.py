"""``logit_bias`` and ``allowed_token_ids`` in the sampler, deterministic parts: the exact logits,
greedy, their place before bans and penalties, raw logprobs, and the fast path without them.

Their sampled distributions are checked statistically in test_sampler_statistics.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from engine.sampling import Sampler, SamplingParams, SamplingRow
from engine.sampling import logit_bias as logit_bias_module
from engine.sampling.logit_bias import apply_allowed_and_bias

NEG_INF = float("-inf")


def row(
    params: SamplingParams,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    banned: Sequence[int] = (),
) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(output), None, list(banned))


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@pytest.fixture(autouse=True)
def _fixed_seed() -> None:
    torch.manual_seed(4321)


def test_bias_is_added_exactly_and_only_to_its_row() -> None:
    logits = torch.randn(4, 50) * 3
    biases = [{3: 100.0, 7: -2.5, 49: 0.25}, {}, {0: -100.0}, {}]
    rows = [row(SamplingParams(logit_bias=b)) for b in biases]
    out = apply_allowed_and_bias(logits, rows)
    expected = logits.clone()
    for i, b in enumerate(biases):
        for token, bias in b.items():
            expected[i, token] += torch.tensor(bias, dtype=torch.float32)
    assert torch.equal(out, expected)  # bit for bit: logits + bias, nothing else
    assert torch.equal(out[1], logits[1]) and torch.equal(out[3], logits[3])


def test_allowed_token_ids_keep_their_logits_and_mask_every_other() -> None:
    logits = torch.randn(3, 40)
    allowed = [[5, 9, 39, 0], None, [12]]
    rows = [row(SamplingParams(allowed_token_ids=a)) for a in allowed]
    out = apply_allowed_and_bias(logits, rows)
    for i, ids in enumerate(allowed):
        if ids is None:
            assert torch.equal(out[i], logits[i])
            continue
        keep = torch.zeros(40, dtype=torch.bool)
        keep[ids] = True
        assert torch.equal(out[i][keep], logits[i][keep])
        assert torch.all(out[i][~keep] == NEG_INF)


def test_bias_cannot_bring_back_a_disallowed_token() -> None:
    logits = torch.zeros(1, 10)
    params = SamplingParams(temperature=0, allowed_token_ids=[1, 2], logit_bias={5: 100, 2: 1})
    out = apply_allowed_and_bias(logits, [row(params)])
    assert out[0, 5] == NEG_INF and out[0, 2] == 1.0 and out[0, 1] == 0.0
    assert Sampler()(logits, [row(params)]).sampled_token_ids == [2]


def test_greedy_picks_the_biased_argmax() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, -1.0]] * 4)
    rows = [
        row(SamplingParams(temperature=0, logit_bias={3: 100})),  # forced
        row(SamplingParams(temperature=0, logit_bias={0: -100})),  # banned in all but name
        row(SamplingParams(temperature=0, logit_bias={2: 2.5})),  # 4.5 > 4
        row(SamplingParams(temperature=0)),
    ]
    assert Sampler()(logits, rows).sampled_token_ids == [3, 1, 2, 0]  # all-greedy fast path
    mixed = [*rows, row(SamplingParams(temperature=1.0, logit_bias={1: 100}))]
    logits = torch.cat([logits, logits[:1]])
    assert Sampler()(logits, mixed).sampled_token_ids == [3, 1, 2, 0, 1]


def test_greedy_picks_the_best_allowed_token() -> None:
    logits = torch.randn(6, 300)
    allowed = [[7, 100, 250], [3], list(range(0, 300, 2))]
    rows = [row(SamplingParams(temperature=0, allowed_token_ids=a)) for a in allowed]
    rows += [row(SamplingParams(temperature=0.0))] * 3
    sampled = Sampler()(logits, rows).sampled_token_ids
    for i, ids in enumerate(allowed):
        assert sampled[i] == ids[int(logits[i, ids].argmax())]
    assert sampled[3:] == logits[3:].argmax(-1).tolist()


def test_allowed_and_bias_come_before_bans_and_penalties() -> None:
    """vLLM v1's order: allowed-token mask, min_tokens bans and logit bias, then repetition,
    presence and frequency penalties. Token 1 (in the prompt, logit -1, bias +2.2) reads
    (-1 + 2.2) / 2 = 0.6 with the bias first and beats token 0's 0.4; the repetition penalty
    first would give -1 * 2 + 2.2 = 0.2, and token 0 would win."""
    logits = torch.tensor([[0.4, -1.0, 0.3, 0.2, 5.0]])
    params = SamplingParams(
        temperature=0,
        repetition_penalty=2.0,
        presence_penalty=0.1,
        allowed_token_ids=[0, 1, 2, 3],  # the natural argmax (4) is not allowed
        logit_bias={1: 2.2, 3: 1.0},  # token 3 would win at 1.2, but it is banned
    )
    r = row(params, prompt=[1, 2], output=[2], banned=[3])
    assert Sampler()(logits, [r]).sampled_token_ids == [1]
    x = np.array([0.4, -1.0, 0.3, 0.2, 5.0])
    x[4] = -np.inf  # not allowed
    x[[1, 3]] += [2.2, 1.0]  # bias
    x[3] = -np.inf  # banned
    x[[1, 2]] = np.where(x[[1, 2]] > 0, x[[1, 2]] / 2.0, x[[1, 2]] * 2.0)  # repetition
    x[2] -= 0.1  # presence
    assert int(np.argmax(x)) == 1
    np.testing.assert_allclose(x[:3], [0.4, 0.6, 0.05])


def test_logprobs_stay_those_of_the_raw_distribution() -> None:
    """vLLM's default logprobs mode, ``raw_logprobs``: before the mask and the bias."""
    logits = torch.randn(3, 30) * 2
    raw = np_log_softmax(logits.numpy())
    weakest = int(np.argmin(raw[0]))
    cases = [
        SamplingParams(temperature=0, logprobs=5, logit_bias={weakest: 100}),
        SamplingParams(temperature=0.7, logprobs=3, allowed_token_ids=[4, 5, 6]),
        SamplingParams(temperature=0, logprobs=20, logit_bias={1: -100}, allowed_token_ids=[1, 2]),
    ]
    out = Sampler()(logits, [row(p) for p in cases])
    assert out.sampled_token_ids[0] == weakest
    assert out.sampled_token_ids[1] in (4, 5, 6)
    assert out.sampled_token_ids[2] == 2
    for i, params in enumerate(cases):
        result = out.logprobs[i]
        assert result is not None
        token = out.sampled_token_ids[i]
        assert result.sampled_logprob == pytest.approx(raw[i, token], abs=1e-5)
        assert result.sampled_rank == 1 + int((raw[i] > raw[i, token]).sum())
        num_top = params.logprobs or 0
        assert list(result.top_token_ids) == list(np.argsort(-raw[i])[:num_top])
        np.testing.assert_allclose(result.top_logprobs, np.sort(raw[i])[::-1][:num_top], atol=1e-5)
    first = out.logprobs[0]
    assert first is not None and first.sampled_rank == 30  # the least likely token, forced


def test_a_batch_without_them_builds_and_copies_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object) -> None:
        raise AssertionError("allowed-token or bias work ran for a batch without either")

    monkeypatch.setattr(logit_bias_module, "_keep_allowed", forbidden)
    monkeypatch.setattr(logit_bias_module, "_add_bias", forbidden)
    monkeypatch.setattr(logit_bias_module.torch, "tensor", forbidden)
    logits = torch.randn(5, 64)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(top_k=5, logit_bias={}),  # an empty bias is no bias
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(seed=3, top_p=0.9),
        SamplingParams(min_p=0.1, logprobs=2),
    ]
    rows = [row(p, prompt=[1, 2]) for p in params]
    assert apply_allowed_and_bias(logits, rows) is logits
    monkeypatch.undo()  # the sampler's other steps need torch.tensor
    monkeypatch.setattr(logit_bias_module, "_keep_allowed", forbidden)
    monkeypatch.setattr(logit_bias_module, "_add_bias", forbidden)
    assert len(Sampler()(logits, rows).sampled_token_ids) == 5


def test_rows_without_them_are_untouched_in_a_mixed_batch() -> None:
    logits = torch.randn(4, 64)
    params = [
        SamplingParams(logit_bias={5: 3.0}),
        SamplingParams(),
        SamplingParams(allowed_token_ids=[1, 2]),
        SamplingParams(temperature=0),
    ]
    out = apply_allowed_and_bias(logits, [row(p) for p in params])
    assert torch.equal(out[1], logits[1]) and torch.equal(out[3], logits[3])


def test_input_logits_are_not_modified() -> None:
    logits = torch.randn(2, 30)
    before = logits.clone()
    rows = [
        row(SamplingParams(logit_bias={1: 5}, repetition_penalty=1.5), prompt=[1], banned=[2]),
        row(SamplingParams(allowed_token_ids=[3, 4], temperature=0)),
    ]
    Sampler()(logits, rows)
    assert torch.equal(logits, before)
