"""vLLM's ``prompt_logprobs``: the params field, the values against transformers, and every path
a prompt takes through the engine (chunks, a mixed batch, a warm prefix cache, n > 1,
preemption); a batch that does not ask computes nothing more."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import engine.model_runner as model_runner_module
from engine import LLM, LLMEngine, SamplingParams
from engine.kv_cache.block_manager import BlockManager
from engine.outputs import PromptLogprobs
from engine.prompt_logprobs import PromptLogprobsSpan, prompt_logprobs_spans
from engine.sampling import PromptTokenLogprobs
from engine.scheduler import ModelRunnerOutput, Scheduler, SchedulerConfig, Sequence
from tests.engine.hf_reference import hf_greedy, hf_log_softmax
from tests.engine.test_parity import make_prompts

ATOL = 1e-4


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8)


def assert_matches_transformers(
    model_dir: Path, prompt: list[int], prompt_logprobs: PromptLogprobs | None, num_top: int
) -> None:
    """Per position: the prompt token first with its logprob and vLLM's rank (tokens at least
    as likely), then transformers' top-``num_top`` ranked 1..N by place."""
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    reference = hf_log_softmax(model_dir, prompt)  # [len(prompt), vocab]
    for position in range(1, len(prompt)):
        entry = prompt_logprobs[position]
        assert entry is not None
        expected = reference[position - 1]  # the distribution the token was drawn from
        token = prompt[position]
        top_ids = torch.topk(expected, num_top).indices.tolist() if num_top else []
        assert list(entry) == list(dict.fromkeys([token, *top_ids])), position
        for token_id, logprob in entry.items():
            assert abs(logprob.logprob - expected[token_id].item()) < ATOL, (position, token_id)
        for place, top_id in enumerate(top_ids, start=1):
            assert entry[top_id].rank == place
        if token not in top_ids:
            value = expected[token].item()
            assert (expected > value + ATOL).sum() < entry[token].rank
            assert entry[token].rank <= (expected >= value - ATOL).sum()


def generated(engine: LLMEngine) -> Iterator[Any]:
    """Step ``engine`` until it is empty; yields each step's result."""
    while engine.has_unfinished_requests():
        yield engine.step()


def without_text(prompt_logprobs: PromptLogprobs | None) -> list[dict[int, tuple]] | None:
    if prompt_logprobs is None:
        return None
    return [
        {} if p is None else {t: (lp.logprob, lp.rank) for t, lp in p.items()}
        for p in prompt_logprobs
    ]


class LogitsRows:
    """Counts the rows the model turns into logits."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, engine: LLMEngine) -> None:
        self.num_rows = 0
        model = engine.runner.model
        original = model.compute_logits

        def counting(hidden: torch.Tensor) -> torch.Tensor:
            self.num_rows += hidden.shape[0]
            return original(hidden)

        monkeypatch.setattr(model, "compute_logits", counting)


class SpanLog:
    """Records the prompt positions each step's prompt logprobs cover, by sequence."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.spans: list[PromptLogprobsSpan] = []
        original = model_runner_module.compute_prompt_logprobs

        def recording(*args: Any) -> dict[int, PromptTokenLogprobs]:
            self.spans += args[2]
            return original(*args)

        monkeypatch.setattr(model_runner_module, "compute_prompt_logprobs", recording)

    def positions(self) -> list[int]:
        return [
            p
            for s in self.spans
            for p in range(s.first_position, s.first_position + len(s.token_ids))
        ]


# ---------------------------------------------------------------- the params field


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (True, r"prompt_logprobs must be an int in \[0, 20\] or None, got bool"),
        (2.0, r"prompt_logprobs must be an int in \[0, 20\] or None, got float"),
        (21, r"prompt_logprobs must be an int in \[0, 20\] or None, got 21"),
        (-2, r"prompt_logprobs must be an int in \[0, 20\] or None, got -2"),
        (-1, r"prompt_logprobs=-1 .*whole vocabulary.* not supported.*\[0, 20\]"),
        ("3", r"prompt_logprobs must be an int in \[0, 20\]"),
    ],
)
def test_bad_values_name_the_field_and_the_limit(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]


def test_good_values_are_kept() -> None:
    assert SamplingParams().prompt_logprobs is None
    assert [SamplingParams(prompt_logprobs=k).prompt_logprobs for k in (0, 5, 20)] == [0, 5, 20]


# ---------------------------------------------------------------- values


def test_prompt_logprobs_match_transformers_log_softmax(llm: LLM, llama_dir: Path) -> None:
    prompts = make_prompts(seed=21)[:4]  # 1, 3, 17 and 40 tokens
    num_tops = [3, 0, 20, 5]
    params = [
        SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=k, logprobs=2)
        for k in num_tops
    ]
    outputs = llm.generate(prompts, params)
    for prompt, out, num_top in zip(prompts, outputs, num_tops):
        assert_matches_transformers(llama_dir, prompt, out.prompt_logprobs, num_top)
        assert out.num_cached_tokens == 0
    assert outputs[0].prompt_logprobs == [None]
    assert llm.tokenizer is not None
    entry = outputs[3].prompt_logprobs[7]  # type: ignore[index]
    assert entry is not None
    assert {t: lp.decoded_token for t, lp in entry.items()} == {
        t: llm.tokenizer.decode([t]) for t in entry
    }
    # asking for them changes nothing else
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, logprobs=2))
    for out, reference in zip(outputs, plain):
        assert reference.prompt_logprobs is None
        assert out.outputs[0].token_ids == reference.outputs[0].token_ids
        for position, expected in zip(
            out.outputs[0].logprobs or [], reference.outputs[0].logprobs or []
        ):
            assert list(position) == list(expected)
            for token_id, logprob in position.items():
                assert logprob.logprob == pytest.approx(expected[token_id].logprob, abs=ATOL)


def test_chunked_prefill_gives_every_position_once_across_chunk_boundaries(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chunked = LLM(
        str(llama_dir), dtype="float32", device="cpu", block_size=8, max_num_batched_tokens=16
    )
    log = SpanLog(monkeypatch)
    prompts = make_prompts(seed=22)[3:6]  # 40, 64 and 100 tokens: 3, 4 and 7 chunks of 16
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=4)
    outputs = chunked.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        assert_matches_transformers(llama_dir, prompt, out.prompt_logprobs, 4)
    # each prompt ran in several chunks; their spans are adjacent and cover it once
    for seq_id, prompt in enumerate(prompts):
        spans = [s for s in log.spans if s.seq_id == seq_id]
        assert len(spans) >= 3
        assert spans[0].first_position == 1
        for before, after in zip(spans, spans[1:]):
            assert after.first_position == before.first_position + len(before.token_ids)
        assert spans[-1].first_position + len(spans[-1].token_ids) == len(prompt)


def test_a_mixed_batch_turns_only_the_asking_rows_into_logits(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8).engine
    rows = LogitsRows(monkeypatch, engine)
    prompts = make_prompts(seed=23)[2:7]
    for i, prompt in enumerate(prompts):
        asks = 6 if i == 2 else None
        params = SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=asks)
        engine.add_request(f"r{i}", prompt, params)
    finished = {o.request_id: o for step in generated(engine) for o in step.finished}
    assert_matches_transformers(llama_dir, prompts[2], finished["r2"].prompt_logprobs, 6)
    assert all(finished[f"r{i}"].prompt_logprobs is None for i in (0, 1, 3, 4))
    num_sampled = sum(len(o.outputs[0].token_ids) for o in finished.values())
    assert rows.num_rows == num_sampled + len(prompts[2]) - 1


def test_a_batch_without_prompt_logprobs_computes_nothing_more(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("prompt logprobs computed for a batch that did not ask")

    monkeypatch.setattr(model_runner_module, "compute_prompt_logprobs", refuse)
    rows = LogitsRows(monkeypatch, llm.engine)
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=3),
        SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=1),
        SamplingParams(temperature=0.0, max_tokens=6),
    ]
    outputs = llm.generate(make_prompts(seed=24)[3:6], params)
    assert all(o.prompt_logprobs is None for o in outputs)
    assert rows.num_rows == sum(len(c.token_ids) for o in outputs for c in o.outputs)


def test_a_warm_prefix_cache_is_not_used_but_is_filled(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8)
    prompt, other = make_prompts(seed=25)[5], make_prompts(seed=26)[5]  # 100 tokens each
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    asking = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    (warm,) = llm.generate([prompt], plain)
    (again,) = llm.generate([prompt], plain)
    assert again.num_cached_tokens == 96  # the cache is warm for this prompt
    (out,) = llm.generate([prompt], asking)
    assert out.num_cached_tokens == 0
    assert_matches_transformers(llama_dir, prompt, out.prompt_logprobs, 2)
    assert out.outputs[0].token_ids == warm.outputs[0].token_ids
    # a request asking for them still fills the cache for the others
    (first,) = llm.generate([other], asking)
    assert first.num_cached_tokens == 0
    (later,) = llm.generate([other], plain)
    assert later.num_cached_tokens == 96


def test_parallel_samples_get_one_list_per_request(llm: LLM, llama_dir: Path) -> None:
    prompt = make_prompts(seed=27)[4]
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=8, prompt_logprobs=3)
    engine = llm.engine
    engine.add_request("n3", prompt, params)
    steps = list(generated(engine))
    (out,) = [o for step in steps for o in step.finished]
    assert len(out.outputs) == 3
    assert_matches_transformers(llama_dir, prompt, out.prompt_logprobs, 3)
    # the first token events carry them once, on sample 0
    carrying = [e for step in steps for e in step.new_tokens if e.prompt_logprobs is not None]
    assert [(e.sample_index, e.position) for e in carrying] == [(0, 0)]
    assert carrying[0].prompt_logprobs.first_position == 1
    assert carrying[0].prompt_logprobs.num_positions == len(prompt) - 1
    (single,) = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3))
    assert without_text(single.prompt_logprobs) == without_text(out.prompt_logprobs)


def test_preemption_recompute_neither_repeats_nor_loses_a_position(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 18 blocks of 8 cannot hold both: the newest, "b", is preempted in the middle of its
    # prompt (again and again while "a" grows) and recomputes it each time
    engine = LLM(
        str(llama_dir),
        dtype="float32",
        device="cpu",
        block_size=8,
        max_num_batched_tokens=32,
        num_kv_blocks=18,
    ).engine
    log = SpanLog(monkeypatch)
    preempted: list[tuple[str, int]] = []  # request id, prompt tokens computed
    preempt = engine.scheduler._preempt

    def recording(seq: Sequence) -> None:
        preempted.append((seq.request_id, min(seq.num_computed_tokens, seq.num_prompt_tokens)))
        preempt(seq)

    monkeypatch.setattr(engine.scheduler, "_preempt", recording)
    prompts = make_prompts(seed=28)
    requests = {
        "a": (prompts[3], SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)),
        "b": (prompts[5], SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=2)),
    }
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finished = {o.request_id: o for step in generated(engine) for o in step.finished}
    b = requests["b"][0]
    assert any(rid == "b" and 0 < computed < len(b) for rid, computed in preempted)
    assert log.positions() == list(range(1, len(b)))  # each position once, in order
    assert_matches_transformers(llama_dir, b, finished["b"].prompt_logprobs, 2)
    assert finished["b"].outputs[0].token_ids == hf_greedy(llama_dir, b, 8)


# ---------------------------------------------------------------- scheduler, no model


def test_owed_positions_survive_preemption_and_skip_the_cache() -> None:
    """Scheduler and spans alone: chunks of 8, a preemption in the middle of the prompt and one
    after it; the prompt's positions are each given once, none from the prefix cache."""
    manager = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8), manager, [2])
    prompt = list(range(3, 30))  # 27 tokens
    ids = itertools.count()

    def add(prompt_logprobs: int | None) -> Sequence:
        params = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=prompt_logprobs)
        seq = Sequence(
            scheduler.new_seq_id(),
            f"r{next(ids)}",
            prompt,
            params,
            len(prompt) + 4,
            prompt_logprobs=prompt_logprobs is not None,
        )
        scheduler.add(seq)
        return seq

    def step() -> list[PromptLogprobsSpan]:
        out = scheduler.schedule()
        spans = prompt_logprobs_spans(out.scheduled)
        sampled = {t.seq_id: 7 for e in out.scheduled for t in e.sample_seqs}
        scheduler.update(out, ModelRunnerOutput(sampled))
        return spans

    add(None)
    while scheduler.num_unfinished:
        assert step() == []  # nothing owed, nothing computed
    num_hits = manager.pool.num_cache_hits  # the prompt's blocks are cached now
    seq = add(1)
    spans = step() + step()  # positions 1..16
    assert seq.num_cached_prompt_tokens == 0 and seq.num_prompt_logprob_positions == 17
    scheduler._preempt(scheduler.running.pop())
    while seq.num_output_tokens < 2:
        spans += step()
    assert manager.pool.num_cache_hits == num_hits
    scheduler._preempt(scheduler.running.pop())  # after the prompt: it may use the cache now
    while scheduler.num_unfinished:
        spans += step()
    assert manager.pool.num_cache_hits > num_hits
    positions = [
        p for s in spans for p in range(s.first_position, s.first_position + len(s.token_ids))
    ]
    assert positions == list(range(1, len(prompt)))
    assert [t for s in spans for t in s.token_ids] == prompt[1:]
    assert not seq.owes_prompt_logprobs and seq.num_preemptions == 2
