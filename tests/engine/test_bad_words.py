"""vLLM's ``bad_words``: the params field, its tokenization, the sampler's ban (output tokens
only, the suffix rule), the engine's vocabulary check and the offline API on a tiny model."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from engine import LLM
from engine.sampling import Sampler, SamplingParams, SamplingRow
from engine.sampling import logit_bias as logit_bias_module
from engine.sampling.logit_bias import apply_allowed_and_bias
from engine.tokenizer import bad_words_token_ids
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_parity import make_prompts

NEG_INF = float("-inf")


def row(
    params: SamplingParams, output: Sequence[int] = (), prompt: Sequence[int] = ()
) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(output), None)


def banned(params: SamplingParams, output: Sequence[int], prompt: Sequence[int] = ()) -> set[int]:
    logits = torch.zeros(1, 16)
    out = apply_allowed_and_bias(logits, [row(params, output, prompt)])
    return {int(t) for t in torch.nonzero(out[0] == NEG_INF).flatten()}


# ---------------------------------------------------------------- the sampler


def test_a_single_token_bad_word_is_never_produced() -> None:
    logits = torch.tensor([[1.0, 5.0, 4.0, 0.0]])
    params = SamplingParams(temperature=0, bad_words_token_ids=[[1]])
    assert Sampler()(logits, [row(params)]).sampled_token_ids == [2]  # the next best
    sampled = SamplingParams(temperature=1.0, bad_words_token_ids=[[1]])
    logits = torch.tensor([[0.0, 8.0, 0.0, 0.0]]).repeat(512, 1)  # token 1 holds ~99.9%
    for _ in range(4):
        drawn = Sampler()(logits, [row(sampled)] * 512).sampled_token_ids
        assert 1 not in drawn and set(drawn) == {0, 2, 3}


def test_a_multi_token_bad_word_bans_its_last_token_only_after_its_prefix() -> None:
    params = SamplingParams(bad_words_token_ids=[[5, 7], [3, 4, 9]])
    assert banned(params, [1, 2, 5]) == {7}
    assert banned(params, [5, 2]) == set()  # the prefix must END the output
    assert banned(params, []) == set()
    assert banned(params, [3, 4]) == {9}
    assert banned(params, [6, 4]) == set()  # all of the prefix must match
    assert banned(params, [4]) == set()
    assert banned(params, [3, 4, 5]) == {7}


def test_prompt_tokens_do_not_count() -> None:
    params = SamplingParams(bad_words_token_ids=[[5, 7], [3, 4, 9]])
    assert banned(params, [], prompt=[1, 5]) == set()
    assert banned(params, [4], prompt=[3]) == set()  # prefix split between prompt and output
    assert banned(params, [5], prompt=[1]) == {7}


def test_greedy_avoids_the_completion_and_the_bias_cannot_bring_it_back() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 9.0]] * 2)
    params = SamplingParams(temperature=0, bad_words_token_ids=[[5, 7]], logit_bias={7: 100})
    rows = [row(params, [5]), row(params, [6])]
    assert Sampler()(logits, rows).sampled_token_ids == [1, 7]


def test_a_batch_without_bad_words_copies_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object) -> None:
        raise AssertionError("bad-words work ran for a batch without bad words")

    monkeypatch.setattr(logit_bias_module, "ban_bad_words", forbidden)
    logits = torch.randn(2, 32)
    rows = [row(SamplingParams(temperature=0), [1, 2]), row(SamplingParams(seed=1), [3])]
    assert apply_allowed_and_bias(logits, rows) is logits  # no copy, nothing built
    assert len(Sampler()(logits, rows).sampled_token_ids) == 2
    assert not SamplingParams().uses_token_history  # the model runner copies no history
    assert SamplingParams(bad_words_token_ids=[[1]]).uses_token_history


def test_rows_without_bad_words_are_untouched_in_a_mixed_batch() -> None:
    logits = torch.randn(2, 16)
    rows = [row(SamplingParams(bad_words_token_ids=[[3]]), [1]), row(SamplingParams(), [1])]
    out = apply_allowed_and_bias(logits, rows)
    assert out[0, 3] == NEG_INF and torch.equal(out[1], logits[1])
    assert not torch.equal(out[0], logits[0]) and logits[0, 3] != NEG_INF


# ---------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bad_words_token_ids": [[]]}, r"bad_words_token_ids\[0\] must hold at least 1 token"),
        ({"bad_words_token_ids": [[1, -2]]}, r"bad_words_token_ids\[0\]\[1\] must be >= 0"),
        ({"bad_words_token_ids": [[1.5]]}, r"bad_words_token_ids\[0\]\[0\] must be an int"),
        ({"bad_words_token_ids": [1, 2]}, r"bad_words_token_ids\[0\] must be a list or tuple"),
        ({"bad_words_token_ids": "ab"}, "bad_words_token_ids must be a list of token id lists"),
        (
            {"bad_words_token_ids": [[1]] * 129},
            "bad_words_token_ids must hold at most 128 sequences, got 129",
        ),
        (
            {"bad_words_token_ids": [[1] * 600, [2] * 425]},
            "bad_words_token_ids must hold at most 1024 token ids in all, got 1025",
        ),
        ({"bad_words": "word"}, "bad_words must be a list of strings"),
        ({"bad_words": ["a", 3]}, r"bad_words\[1\] must be a string"),
        ({"bad_words": ["a"] * 129}, "bad_words must hold at most 128 words, got 129"),
    ],
)
def test_bad_values_name_the_field_and_the_limit(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_values_are_stored_immutably() -> None:
    params = SamplingParams(bad_words=["a", "b c"], bad_words_token_ids=[[1, 2], (3,)])
    assert params.bad_words == ("a", "b c")
    assert params.bad_words_token_ids == ((1, 2), (3,))
    assert SamplingParams(bad_words_token_ids=[[1]] * 128, bad_words=[]).bad_words is None
    hash(params)


# ---------------------------------------------------------------- tokenization


def vllm_reference(tokenizer: Any, words: Sequence[str]) -> list[list[int]]:
    """``SamplingParams.update_from_tokenizer`` of vLLM, written out as it reads."""
    result: list[list[int]] = []
    for word in words:
        for add_prefix_space in [False, True]:
            prompt = (" " if add_prefix_space else "") + word.lstrip()
            ids = tokenizer.encode(text=prompt, add_special_tokens=False)
            if not add_prefix_space or (ids[0] != result[-1][0] and len(ids) == len(result[-1])):
                result.append(ids)
    return result


def test_tokenization_follows_vllm(llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    words = ["main", " return", "self.value", "x", "  def main", "import os"]
    got = bad_words_token_ids(tokenizer, words)
    assert got == vllm_reference(tokenizer, words)
    assert any(len(got_ids) > 1 for got_ids in got)
    assert len(got) > len(words)  # some spaced forms are kept ...
    assert len(got) < 2 * len(words)  # ... and some are not
    with pytest.raises(ValueError, match=r"bad_words\[1\] \(' '\) must encode to at least one"):
        bad_words_token_ids(tokenizer, ["a", " "])


# ---------------------------------------------------------------- engine and offline API


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8)


def test_greedy_output_matches_transformers_bad_words_ids(llm: LLM, llama_dir: Path) -> None:
    prompt = make_prompts(seed=13)[2]
    common: dict[str, Any] = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    natural = llm.generate([prompt], SamplingParams(**common))[0].outputs[0].token_ids
    one = [[natural[0]]]
    first = llm.generate([prompt], SamplingParams(**common, bad_words_token_ids=one))
    without_one = first[0].outputs[0].token_ids
    # one-token words are banned everywhere by both; a two-token word whose first token does not
    # end the prompt is banned by both exactly where the OUTPUT ends with that first token
    two = without_one[3:5]
    assert prompt[-1] != two[0]
    bad = [*one, two]
    params = SamplingParams(**common, bad_words_token_ids=bad)
    out = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert out == hf_greedy(llama_dir, prompt, 12, bad_words_ids=bad)
    assert out[:3] == without_one[:3] != natural[:3]  # both bans took effect where they should
    assert out != without_one and natural[0] not in out
    assert all(out[i : i + 2] != two for i in range(len(out) - 1))


def test_text_bad_words_are_tokenized_by_generate(llm: LLM) -> None:
    assert llm.tokenizer is not None
    prompt = "def main():"
    common: dict[str, Any] = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    natural = llm.generate([prompt], SamplingParams(**common))[0].outputs[0]
    word = llm.tokenizer.decode(natural.token_ids[:1])  # " line": banned in its spaced form
    ids = bad_words_token_ids(llm.tokenizer, [word])
    assert [natural.token_ids[0]] in ids
    by_text = llm.generate([prompt], SamplingParams(**common, bad_words=[word]))[0].outputs[0]
    by_ids = llm.generate([prompt], SamplingParams(**common, bad_words_token_ids=ids))[0]
    assert by_text.token_ids == by_ids.outputs[0].token_ids != natural.token_ids
    for seq in ids:
        n = len(seq)
        assert all(by_text.token_ids[i : i + n] != seq for i in range(len(by_text.token_ids)))


def test_bad_word_ids_outside_the_vocabulary_are_refused(llm: LLM) -> None:
    params = SamplingParams(bad_words_token_ids=[[5], [6, 1024]])
    with pytest.raises(ValueError, match=r"bad_words_token_ids\[1\] holds token id 1024"):
        llm.generate([[5, 6, 7]], params)
    with pytest.raises(ValueError, match="bad_words must be tokenized"):
        llm.engine.add_request("text-only", [5, 6], SamplingParams(bad_words=["x"]))
    assert not llm.engine.has_unfinished_requests()
