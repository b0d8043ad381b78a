"""``LLM.beam_search`` finds what transformers' ``generate(num_beams=...)`` finds: the same
beams in the same order, with eos ending hypotheses, length penalties and each early-stopping
rule; and bad parameters are refused naming the field."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from engine import LLM, BeamSearchParams, SamplingParams
from engine.beam_search import BeamSearch
from tests.engine.hf_reference import hf_beams
from tests.engine.test_parity import make_prompts

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8)


@pytest.fixture(scope="module")
def eos_model(llama_dir: Path, llm: LLM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with, as its eos, the token its greedy outputs pick most: beams then
    end in eos often, so hypotheses finish at many lengths."""
    prompts = make_prompts(seed=23)[:6]  # those the eos tests search
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    counts = Counter(t for output in outputs for t in output.outputs[0].token_ids)
    eos = counts.most_common(1)[0][0]
    model_dir = tmp_path_factory.mktemp("eos-llama")
    for item in llama_dir.iterdir():
        shutil.copy(item, model_dir / item.name)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((model_dir / name).read_text())
        config["eos_token_id"] = eos
        (model_dir / name).write_text(json.dumps(config))
    return model_dir


@pytest.fixture(scope="module")
def eos_llm(eos_model: Path) -> LLM:
    return LLM(str(eos_model), dtype="float32", device="cpu", block_size=8)


@pytest.mark.parametrize("width", [1, 2, 4])
def test_beams_equal_transformers(llm: LLM, llama_dir: Path, width: int) -> None:
    prompts = make_prompts(seed=22)[:4]
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS)
    outputs = llm.beam_search(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        beams, scores = hf_beams(llama_dir, prompt, width, MAX_TOKENS)
        assert [s.output_token_ids for s in output.sequences] == beams
        if scores is not None:
            assert [s.score for s in output.sequences] == pytest.approx(scores, abs=1e-4)
        for sequence in output.sequences:
            assert sequence.tokens[: len(prompt)] == prompt
            assert sequence.finish_reason == "length"
            chosen = [p[t].logprob for t, p in zip(sequence.output_token_ids, sequence.logprobs)]
            assert sequence.cum_logprob == pytest.approx(sum(chosen), abs=1e-5)
            assert sequence.score == pytest.approx(sequence.cum_logprob / MAX_TOKENS, abs=1e-6)
    if width == 1:  # one beam is greedy decoding
        greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        assert [o.sequences[0].output_token_ids for o in outputs] == [
            g.outputs[0].token_ids for g in greedy
        ]


@pytest.mark.parametrize(
    ("length_penalty", "early_stopping"),
    [(1.0, False), (0.0, False), (2.0, "never"), (-1.0, "never"), (1.0, True)],
)
def test_hypotheses_ended_by_eos_rank_as_in_transformers(
    eos_model: Path, eos_llm: LLM, length_penalty: float, early_stopping: bool | str
) -> None:
    llm = eos_llm
    eos = llm.engine.model_config.eos_token_ids[0]
    prompts = make_prompts(seed=23)[:6]
    params = BeamSearchParams(
        beam_width=3,
        max_tokens=MAX_TOKENS,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    outputs = llm.beam_search(prompts, params)
    ended_by_eos = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        beams, scores = hf_beams(eos_model, prompt, 3, MAX_TOKENS, length_penalty, early_stopping)
        assert [s.output_token_ids for s in output.sequences] == beams
        assert [s.score for s in output.sequences] == pytest.approx(scores, rel=1e-5, abs=1e-4)
        for sequence in output.sequences:
            ends = sequence.output_token_ids[-1] == eos
            assert sequence.finish_reason == ("stop" if ends else "length")
            ended_by_eos += ends
    assert ended_by_eos >= 1  # the eos rules were exercised


def test_ignore_eos_runs_every_beam_to_max_tokens(eos_llm: LLM) -> None:
    llm = eos_llm
    prompts = make_prompts(seed=23)[:3]
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    for output in llm.beam_search(prompts, params):
        assert all(len(s.output_token_ids) == MAX_TOKENS for s in output.sequences)
        assert all(s.finish_reason == "length" for s in output.sequences)


def test_text_prompts_and_vllm_prompt_dicts(llm: LLM) -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    token_ids = llm.tokenizer.encode("def add(a, b):")
    by_text, by_dict, by_ids = llm.beam_search(
        ["def add(a, b):", {"prompt_token_ids": token_ids}, token_ids], params
    )
    assert by_text.sequences[0].tokens == by_dict.sequences[0].tokens == by_ids.sequences[0].tokens
    text = by_text.sequences[0].text
    assert text == llm.tokenizer.decode(by_text.sequences[0].tokens, skip_special_tokens=True)
    (single,) = llm.beam_search({"prompt": "def add(a, b):"}, params)
    assert single.sequences[0].tokens == by_text.sequences[0].tokens


def test_max_tokens_is_cut_to_what_max_model_len_leaves(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8, max_model_len=24)
    prompt = max(make_prompts(seed=24), key=len)[:20]
    (output,) = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=16))
    assert all(len(s.tokens) == 24 for s in output.sequences)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"beam_width": 0}, "beam_width must be an integer >= 1"),
        ({"beam_width": 11}, "beam_width must be at most 10"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"temperature": 0.7}, "temperature must be 0 for beam search"),
        ({"length_penalty": float("nan")}, "length_penalty must be finite"),
        ({"early_stopping": "sometimes"}, "early_stopping must be true, false or 'never'"),
    ],
)
def test_bad_parameters_are_refused_naming_the_field(fields: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        BeamSearch(
            [1, 2], BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **fields}), frozenset({2})
        )
