"""The offline LLM API: logprobs, seeded sampling, n > 1, stop conditions and bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.hf_reference import hf_greedy, hf_log_softmax
from tests.engine.test_parity import make_prompts


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8)


def test_logprobs_match_transformers_log_softmax(llm: LLM, llama_dir: Path) -> None:
    prompt = make_prompts(seed=5)[3]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5)
    (out,) = llm.generate([prompt], params)
    completion = out.outputs[0]
    reference = hf_log_softmax(llama_dir, prompt + completion.token_ids)
    assert completion.logprobs is not None and len(completion.logprobs) == 12
    for step, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
        expected = reference[len(prompt) - 1 + step]
        top = torch.topk(expected, 5)
        assert list(position)[:5] == top.indices.tolist()
        for token_id, logprob in position.items():
            assert abs(logprob.logprob - expected[token_id].item()) < 1e-4
        assert position[token].rank == 1  # greedy picks the most likely token
    assert completion.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs))
    )


def test_seeded_sampling_is_reproducible_across_batch_compositions(llm: LLM) -> None:
    prompts = make_prompts(seed=6)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=1234)
    unseeded = SamplingParams(temperature=1.0, max_tokens=24)
    alone = llm.generate([prompts[2]], seeded)[0].outputs[0].token_ids
    mixed = llm.generate(prompts[:5], [unseeded, unseeded, seeded, unseeded, unseeded])
    later = llm.generate([prompts[7], prompts[2]], [unseeded, seeded])
    assert mixed[2].outputs[0].token_ids == alone
    assert later[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=99)
    assert llm.generate([prompts[2]], other_seed)[0].outputs[0].token_ids != alone


def test_parallel_samples_are_distinct_and_seeded(llm: LLM) -> None:
    prompt = make_prompts(seed=7)[4]
    params = SamplingParams(temperature=1.0, max_tokens=16, n=4, seed=5)
    (first,) = llm.generate([prompt], params)
    (again,) = llm.generate([prompt], params)
    samples = [c.token_ids for c in first.outputs]
    assert len({tuple(s) for s in samples}) > 1
    assert samples == [c.token_ids for c in again.outputs]
    assert all(len(s) == 16 for s in samples)


def test_stop_token_ids_and_min_tokens(llm: LLM, llama_dir: Path) -> None:
    prompt = make_prompts(seed=8)[2]
    greedy = hf_greedy(llama_dir, prompt, 20)
    stop_at = greedy[5]
    first = greedy.index(stop_at)
    (out,) = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at])
    )
    assert out.outputs[0].token_ids == greedy[: first + 1]
    assert out.outputs[0].finish_reason == "stop"
    (out,) = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=20, min_tokens=20, stop_token_ids=[stop_at]),
    )
    assert len(out.outputs[0].token_ids) == 20
    assert stop_at not in out.outputs[0].token_ids  # banned until min_tokens
    assert out.outputs[0].finish_reason == "length"


def test_text_prompts_are_tokenized_and_outputs_detokenized(llm: LLM) -> None:
    (out,) = llm.generate(["def main():"], SamplingParams(temperature=0, max_tokens=8))
    assert llm.tokenizer is not None
    assert out.prompt == "def main():"
    assert out.prompt_token_ids == llm.tokenizer.encode("def main():")
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"temperature": -0.5}, "temperature"),
        ({"logprobs": 21}, "logprobs"),
        ({"bogus_field": 1}, "bogus_field"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_requests_are_refused_and_running_requests_unaffected(
    llm: LLM, llama_dir: Path
) -> None:
    engine = llm.engine
    prompt = make_prompts(seed=9)[4]
    engine.add_request("good", prompt, SamplingParams(temperature=0, max_tokens=30))
    for _ in range(5):
        engine.step()
    bad_requests = [
        ([5] * 600, "max_model_len"),  # longer than the model's 512 positions
        ([5, 1024], "vocabulary"),
        ([5, -1], "vocabulary"),
        ([], "at least 1 token"),
    ]
    for bad_prompt, message in bad_requests:
        with pytest.raises(ValueError, match=message):
            engine.add_request("bad", bad_prompt, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request("bad", [5], SamplingParams(stop_token_ids=[5000]))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", [5], SamplingParams())
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step().finished
    assert [o.request_id for o in finished] == ["good"]
    assert finished[0].outputs[0].token_ids == hf_greedy(llama_dir, prompt, 30)


def test_abort_frees_every_block(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("abort-me", make_prompts(seed=10)[6], SamplingParams(max_tokens=100))
    engine.step()
    assert engine.block_manager.usage > 0
    engine.abort_request("abort-me")
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.usage == 0


def test_mismatched_params_list_is_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="sampling_params has 1 entries"):
        llm.generate([[5, 6], [7, 8]], [SamplingParams()])


def test_engine_options_are_validated(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(str(llama_dir), device="cpu", max_model_len=4096)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(str(llama_dir), device="cpu", enable_chunked_prefill=False, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(llama_dir), device="cpu", dtype="int8")
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(llama_dir), device="cpu", block_size=0)


def test_max_model_len_caps_generation(llama_dir: Path) -> None:
    small = LLM(str(llama_dir), dtype="float32", device="cpu", max_model_len=40)
    (out,) = small.generate(
        [[5] * 30], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    )
    assert len(out.outputs[0].token_ids) == 10
    assert out.outputs[0].finish_reason == "length"


def test_cached_tokens_count_only_what_the_prefix_cache_served_at_first(llama_dir: Path) -> None:
    """Distinct prompts and 16 blocks of 4: preempted sequences come back to a cache holding
    their own blocks, which is not a prefix-cache hit on their prompt (usage would report up
    to 20 cached tokens of a 5-token prompt)."""
    prompts = [prompt[:5] for prompt in make_prompts(seed=7)[2:8]]
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=16)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert llm.engine.num_preemptions > 0
    assert [output.num_cached_tokens for output in outputs] == [0] * len(prompts)


def test_an_interrupted_generate_leaves_the_engine_empty(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C in the third step: the call's requests are aborted (their blocks freed), so the
    next call counts only its own outputs."""
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8)
    free_blocks = llm.engine.block_manager.num_free_blocks
    step = llm.engine.step
    num_steps = 0

    def interrupted_step() -> object:
        nonlocal num_steps
        num_steps += 1
        if num_steps == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    prompts = [prompt[:8] for prompt in make_prompts(seed=3)[3:6]]
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == free_blocks
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    outputs = llm.generate(prompts[:2], params)
    assert [len(output.outputs[0].token_ids) for output in outputs] == [30, 30]


def test_parallel_samples_keep_the_prompt_when_the_first_ends_on_its_first_token(
    llama_dir: Path,
) -> None:
    """n = 3, and sample 0's first token is a stop token: the other samples must be forked
    from the prompt's blocks before sample 0 frees them (they were forked from an empty block
    table, so each prefilled the prompt again, and a disaggregated hand-off had no KV to send)."""
    prompt = make_prompts(seed=4)[2]
    params = SamplingParams(temperature=1.0, n=3, seed=42, max_tokens=8, ignore_eos=True)
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8)
    (free_run,) = llm.generate([prompt], params)
    first_token = free_run.outputs[0].token_ids[0]
    assert first_token not in free_run.outputs[1].token_ids[:1] + free_run.outputs[2].token_ids[:1]
    stopping = SamplingParams(
        temperature=1.0, n=3, seed=42, max_tokens=8, ignore_eos=True, stop_token_ids=[first_token]
    )
    fresh = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8)
    (out,) = fresh.generate([prompt], stopping)
    assert out.outputs[0].token_ids == [first_token] and out.outputs[0].finish_reason == "stop"
    assert fresh.engine.stats.num_prefill_tokens == len(prompt)  # the prompt ran once
    for sample in (1, 2):
        expected = free_run.outputs[sample].token_ids
        if first_token in expected:  # the stop token ends this sample too
            expected = expected[: expected.index(first_token) + 1]
        assert out.outputs[sample].token_ids == expected


def test_text_leaves_out_the_stop_token_and_a_character_cut_short(llm: LLM) -> None:
    """As the gateway's text and vLLM's: the eos or stop id that ended a sample, and the bytes
    of a character the end cut short, are in ``token_ids`` but not in ``text``."""
    tokenizer = llm.tokenizer
    assert tokenizer is not None
    prompt = "def main():"
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    (out,) = llm.generate([prompt], free)
    tokens = out.outputs[0].token_ids
    first = tokens.index(tokens[3])
    params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[tokens[3]])
    (out,) = llm.generate([prompt], params)
    assert out.outputs[0].token_ids == tokens[: first + 1]
    assert out.outputs[0].text == tokenizer.decode(tokens[:first])
    cuts = [n for n in range(1, 41) if tokenizer.decode(tokens[:n]).endswith("\ufffd")]
    assert cuts, "this model's greedy output never ends inside a character"
    for n in cuts:
        (out,) = llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        )
        assert out.outputs[0].text == tokenizer.decode(tokens[:n]).rstrip("\ufffd")


def test_logit_bias_steers_greedy_output(llm: LLM) -> None:
    prompt = make_prompts(seed=11)[3]
    free = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    (natural,) = llm.generate([prompt], free)
    forced_token = next(t for t in range(3, 1024) if t not in natural.outputs[0].token_ids)
    forced = SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True, logit_bias={forced_token: 100}
    )
    (out,) = llm.generate([prompt], forced)
    assert out.outputs[0].token_ids == [forced_token] * 10
    first = natural.outputs[0].token_ids[0]
    avoided = SamplingParams(temperature=0, max_tokens=1, logit_bias={first: -100})
    (out,) = llm.generate([prompt], avoided)
    assert out.outputs[0].token_ids != [first]


def test_allowed_token_ids_confine_sampled_output(llm: LLM) -> None:
    allowed = [40, 41, 300, 777]
    params = SamplingParams(
        temperature=1.5, max_tokens=40, ignore_eos=True, seed=3, allowed_token_ids=allowed
    )
    (out,) = llm.generate([make_prompts(seed=11)[4]], params)
    assert len(out.outputs[0].token_ids) == 40
    assert set(out.outputs[0].token_ids) <= set(allowed)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(logit_bias={5: 1.0, 1024: -5.0}), "logit_bias holds token id 1024"),
        (SamplingParams(allowed_token_ids=[5, 4096]), "allowed_token_ids holds token id 4096"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_field(
    llm: LLM, params: SamplingParams, message: str
) -> None:
    with pytest.raises(ValueError, match=message) as raised:
        llm.generate([[5, 6, 7]], params)
    assert "outside the vocabulary [0, 1024)" in str(raised.value)
    assert not llm.engine.has_unfinished_requests()
