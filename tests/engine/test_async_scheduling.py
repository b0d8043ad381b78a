"""Async scheduling (vLLM's): each ``step()`` schedules and launches the next step before the
step before has given its tokens, and the runner feeds those tokens to it on the device.

Nothing a request sees may change: greedy decoding matches transformers in every engine mode;
everything that reads the step before (seeds, penalties, bad words, min_tokens, stop ids,
logprobs, grammars) matches the same engine without async scheduling; outputs end exactly
where they should; an abort mid-flight frees everything. A log of the engine's calls checks
that the steps really overlap, and that each step samples only once the step before is applied.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import pytest

from engine import LLM, LLMEngine, SamplingParams
from engine.model_runner import LaunchedStep, SampledStep
from engine.outputs import RequestOutput
from engine.scheduler import ModelRunnerOutput, SchedulerOutput
from engine.scheduler.outputs import AppendedTokens, ScheduledSequence
from engine.structured.spec import StructuredOutputSpec
from tests.conftest import ARCHITECTURES
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_disaggregated_engine import _decode_all, _prefill_all
from tests.engine.test_parity import (
    OUTPUT_LENGTHS,
    PROMPT_LENGTHS,
    engine_tokens,
    greedy_params,
    make_prompts,
    reference,
    run_shared_prefixes_twice,
    shared_prefix_prompts,
)
from tests.engine.test_prompt_logprobs import assert_matches_transformers
from tests.engine.test_structured_outputs import SPECS
from tests.fixtures.tiny_tokenizer import EOS_TOKEN_ID

EventKind = Literal["schedule", "schedule-ahead", "launch", "sample", "update"]
# prompts of make_prompts whose reference outputs run their full OUTPUT_LENGTHS (no eos)
LONG_OUTPUTS = (0, 2, 4, 6, 7)  # 64, 16, 33, 64 and 20 tokens


class StepLog:
    """Wraps (does not replace) an engine's ``scheduler.schedule``, ``runner.launch``,
    ``runner.sample`` and ``scheduler.update`` and records each call, in order, with the step
    it concerns; checks every entry that awaits its token when it is launched."""

    def __init__(self, engine: LLMEngine) -> None:
        self.events: list[tuple[EventKind, SchedulerOutput]] = []
        self.num_awaited_entries = 0
        self.misplaced_awaits: list[ScheduledSequence] = []  # awaits it should not have
        scheduler, runner = engine.scheduler, engine.runner
        schedule, update = scheduler.schedule, scheduler.update
        launch, sample = runner.launch, runner.sample
        launched: dict[int, tuple[LaunchedStep, SchedulerOutput]] = {}

        def recording_schedule(*, step_in_flight: bool = False) -> SchedulerOutput:
            output = schedule(step_in_flight=step_in_flight)
            self.events.append(("schedule-ahead" if step_in_flight else "schedule", output))
            return output

        def recording_launch(output: SchedulerOutput) -> LaunchedStep:
            for entry in output.scheduled:
                if entry.awaits_sampled_token:
                    self._check_awaited(entry)
            step = launch(output)
            launched[id(step)] = step, output
            self.events.append(("launch", output))
            return step

        def recording_sample(step: LaunchedStep) -> SampledStep:
            self.events.append(("sample", launched[id(step)][1]))
            return sample(step)

        def recording_update(
            output: SchedulerOutput, result: ModelRunnerOutput
        ) -> list[AppendedTokens]:
            self.events.append(("update", output))
            return update(output, result)

        wrappers: list[tuple[object, str, object]] = [
            (scheduler, "schedule", recording_schedule),
            (scheduler, "update", recording_update),
            (runner, "launch", recording_launch),
            (runner, "sample", recording_sample),
        ]
        for owner, name, wrapper in wrappers:  # on the instances: the engine's own calls
            setattr(owner, name, wrapper)

    def _check_awaited(self, entry: ScheduledSequence) -> None:
        """An awaited token is the one the step in flight samples (not in token_ids yet), for
        a sequence that token cannot end: forked, not prefill-only, short of its limit."""
        self.num_awaited_entries += 1
        seq = entry.seq
        if (
            entry.num_new_tokens != 1
            or entry.start_position != seq.num_tokens
            or not seq.is_forked
            or seq.prefill_only
            or seq.num_tokens + 1 >= seq.max_total_tokens
        ):
            self.misplaced_awaits.append(entry)

    def outputs_of(self, kind: EventKind) -> list[SchedulerOutput]:
        return [output for k, output in self.events if k == kind]

    def num_overlapped_updates(self) -> int:
        """Steps applied after the next step was scheduled ahead and launched."""
        count = 0
        ahead: set[int] = set()
        last_launched: SchedulerOutput | None = None
        for kind, output in self.events:
            if kind == "schedule-ahead":
                ahead.add(id(output))
            elif kind == "launch":
                last_launched = output
            elif kind == "update" and last_launched is not output:
                count += id(last_launched) in ahead
        return count

    def num_stale_samples(self) -> int:
        """Steps sampled while a step launched before them was not applied yet."""
        launched: list[SchedulerOutput] = []
        updated: set[int] = set()
        stale = 0
        for kind, output in self.events:
            if kind == "launch":
                launched.append(output)
            elif kind == "update":
                updated.add(id(output))
            elif kind == "sample":
                before = launched[: [id(o) for o in launched].index(id(output))]
                stale += any(id(o) not in updated for o in before)
        return stale

    def assert_ran_ahead(self) -> None:
        assert self.num_overlapped_updates() > 0
        assert self.num_awaited_entries > 0
        assert self.misplaced_awaits == []
        assert self.num_stale_samples() == 0


def _llm(model_dir: Path, *, async_scheduling: bool = True, **kwargs: Any) -> LLM:
    kwargs.setdefault("block_size", 8)
    return LLM(
        str(model_dir), dtype="float32", device="cpu", async_scheduling=async_scheduling, **kwargs
    )


def _sync_and_async(
    model_dir: Path,
    prompts: list[list[int]],
    params: list[SamplingParams],
    **kwargs: Any,
) -> tuple[list[RequestOutput], list[RequestOutput]]:
    """The same requests on two engines alike but for async scheduling (which must run ahead);
    both end with every KV block free."""
    sync = _llm(model_dir, async_scheduling=False, **kwargs)
    ahead = _llm(model_dir, **kwargs)
    log = StepLog(ahead.engine)
    outputs = sync.generate(prompts, params), ahead.generate(prompts, params)
    log.assert_ran_ahead()
    assert sync.engine.block_manager.usage == ahead.engine.block_manager.usage == 0.0
    return outputs


def _samples(outputs: list[RequestOutput]) -> list[list[tuple[list[int], str | None]]]:
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs]


# ---------------------------------------------------------------- greedy vs transformers


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_batched_greedy_matches_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    model_dir = model_dirs[arch]
    prompts = make_prompts(seed=1)
    llm = _llm(model_dir, block_size=16, enable_prefix_caching=False)
    log = StepLog(llm.engine)
    assert engine_tokens(llm, prompts) == reference(model_dir, prompts, "plain")
    log.assert_ran_ahead()


def test_chunked_prefill_matches_transformers(llama_dir: Path) -> None:
    prompts = make_prompts(seed=1)
    llm = _llm(llama_dir, block_size=16, max_num_batched_tokens=32)
    log = StepLog(llm.engine)
    assert engine_tokens(llm, prompts) == reference(llama_dir, prompts, "plain")
    assert llm.engine.stats.num_steps > sum(PROMPT_LENGTHS) // 32
    log.assert_ran_ahead()
    # prompt chunks (which sample nothing) are scheduled ahead too
    assert any(e.num_new_tokens > 1 for o in log.outputs_of("schedule-ahead") for e in o.scheduled)


def test_prefix_cache_hits_match_transformers(llama_dir: Path) -> None:
    prompts = shared_prefix_prompts(seed=2)
    expected = reference(llama_dir, prompts, "shared-prefix")
    llm = _llm(llama_dir, max_num_batched_tokens=96)
    log = StepLog(llm.engine)
    first = run_shared_prefixes_twice(llm, prompts, expected)
    log.assert_ran_ahead()
    # a prompt admitted ahead finds the blocks the step in flight fills, as stepping in turn
    in_turn = _llm(llama_dir, async_scheduling=False, max_num_batched_tokens=96)
    in_turn_first = in_turn.generate(prompts, greedy_params())
    assert [o.num_cached_tokens for o in first] == [o.num_cached_tokens for o in in_turn_first]


def test_preemption_matches_transformers(llama_dir: Path) -> None:
    """Five requests that grow to 42 blocks of 8 share 14 (the largest alone needs 14): some
    are preempted, only ever by a schedule made with no step in flight (a schedule ahead of
    one comes back empty instead)."""
    chosen = (0, 1, 2, 4, 5)
    prompts = make_prompts(seed=1)
    expected = reference(llama_dir, prompts, "plain")
    params = [SamplingParams(temperature=0.0, max_tokens=OUTPUT_LENGTHS[i]) for i in chosen]
    llm = _llm(llama_dir, num_kv_blocks=14)
    log = StepLog(llm.engine)
    outputs = llm.generate([prompts[i] for i in chosen], params)
    assert [o.outputs[0].token_ids for o in outputs] == [expected[i] for i in chosen]
    assert llm.engine.scheduler.num_preemptions > 0
    ahead = log.outputs_of("schedule-ahead")
    assert all(o.num_preempted == 0 for o in ahead)
    assert any(o.is_empty for o in ahead)  # short of blocks: the next step was scheduled after
    assert sum(o.num_preempted for o in log.outputs_of("schedule")) > 0
    log.assert_ran_ahead()
    assert llm.engine.block_manager.usage == 0.0


def test_parallel_greedy_samples_are_identical(llama_dir: Path) -> None:
    prompt = make_prompts(seed=1)[4]
    expected = reference(llama_dir, make_prompts(seed=1), "plain")[4]
    llm = _llm(llama_dir)
    log = StepLog(llm.engine)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=33, n=3))
    assert [c.token_ids for c in out.outputs] == [expected] * 3
    assert [c.index for c in out.outputs] == [0, 1, 2]
    log.assert_ran_ahead()


# ---------------------------------------------------------------- where outputs end


def test_outputs_hold_exactly_max_tokens(llama_dir: Path) -> None:
    """A sequence one token short of max_tokens waits a step: no token of a step run ahead
    leaks into an output, for max_tokens 1 and 2 as for more, and n > 1."""
    prompts = make_prompts(seed=1)
    expected = reference(llama_dir, prompts, "plain")
    cases = [(i, m, n) for i in LONG_OUTPUTS for m in (1, 2, 3, 16) for n in (1, 2)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, n=n, ignore_eos=True) for _, m, n in cases
    ]
    sync, ahead = _sync_and_async(llama_dir, [prompts[i] for i, _, _ in cases], params)
    for (i, m, n), out in zip(cases, ahead, strict=True):
        assert _samples([out]) == [[(expected[i][:m], "length")] * n]
    assert _samples(ahead) == _samples(sync)


def test_stop_ids_and_eos_end_outputs_where_sync_does(llama_dir: Path) -> None:
    """A sample ending on a stop id or eos computed one more token, thrown away. With eos
    biased up it ends right after min_tokens: sampling that saw one token less would end a
    token later."""
    prompts = make_prompts(seed=1)
    expected = reference(llama_dir, prompts, "plain")
    cases: list[tuple[int, SamplingParams, list[int]]] = []
    for i in LONG_OUTPUTS:
        greedy = expected[i]
        stop_at = greedy[5]
        stopped = greedy[: greedy.index(stop_at) + 1]
        cases.append(
            (i, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_at]), stopped)
        )
        for min_tokens in (0, 1, 3, 7):
            params = SamplingParams(
                temperature=0, max_tokens=16, min_tokens=min_tokens, logit_bias={EOS_TOKEN_ID: 100}
            )
            cases.append((i, params, greedy[:min_tokens] + [EOS_TOKEN_ID]))
    sync, ahead = _sync_and_async(
        llama_dir, [prompts[i] for i, _, _ in cases], [p for _, p, _ in cases]
    )
    assert _samples(ahead) == [[(tokens, "stop")] for _, _, tokens in cases]
    assert _samples(ahead) == _samples(sync)


# ---------------------------------------------------------------- sampling reads the step before


def test_seeded_sampling_equals_sync(llama_dir: Path) -> None:
    prompts = make_prompts(seed=6)[:6]
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, n=1 + 2 * (i % 2), seed=40 + i)
        for i in range(len(prompts))
    ]
    sync, ahead = _sync_and_async(llama_dir, prompts, params)
    assert _samples(ahead) == _samples(sync)
    assert len({tuple(c.token_ids) for c in ahead[1].outputs}) > 1  # n = 3 samples differ


def test_penalties_and_bad_words_see_the_token_just_drawn(llama_dir: Path) -> None:
    """Greedy under penalties of the output so far, and a two-token bad word whose second
    token is banned only right after the first: both read the step before's token."""
    prompts = make_prompts(seed=1)
    expected = reference(llama_dir, prompts, "plain")
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    penalized = [
        replace(greedy, repetition_penalty=2.0),
        replace(greedy, frequency_penalty=2.0),
        replace(greedy, presence_penalty=2.0),
        replace(greedy, repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5),
    ]
    cases = [(i, params) for i in (0, 6) for params in penalized]
    bad_words = {i: [expected[i][3:5]] for i in (2, 4, 7)}
    cases += [
        (i, SamplingParams(temperature=0.0, max_tokens=16, bad_words_token_ids=bad))
        for i, bad in bad_words.items()
    ]
    sync, ahead = _sync_and_async(llama_dir, [prompts[i] for i, _ in cases], [p for _, p in cases])
    assert _samples(ahead) == _samples(sync)
    num_penalized = len(penalized) * 2
    for out, (i, _) in zip(ahead[:num_penalized], cases):  # the penalties change the outputs
        assert out.outputs[0].token_ids != expected[i][:32]
    for out, (i, bad) in zip(ahead[num_penalized:], bad_words.items(), strict=True):
        assert out.outputs[0].token_ids == hf_greedy(llama_dir, prompts[i], 16, bad)


def test_logprobs_equal_sync(llama_dir: Path) -> None:
    prompts = make_prompts(seed=5)[:6]
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.8, max_tokens=12, logprobs=3, seed=i)
        for i in range(len(prompts))
    ]
    sync, ahead = _sync_and_async(llama_dir, prompts, params)
    assert _samples(ahead) == _samples(sync)
    for out, reference_out in zip(ahead, sync, strict=True):
        positions, expected = out.outputs[0].logprobs, reference_out.outputs[0].logprobs
        assert positions is not None and expected is not None
        assert [list(p) for p in positions] == [list(p) for p in expected]  # ids, in order
        for position, expected_position in zip(positions, expected, strict=True):
            for token_id, logprob in position.items():
                assert logprob.rank == expected_position[token_id].rank
                # the two engines batch steps differently: float sums may differ in the last bit
                assert logprob.logprob == pytest.approx(
                    expected_position[token_id].logprob, abs=1e-5
                )


def test_prompt_logprobs_of_chunks_run_ahead_match_transformers(llama_dir: Path) -> None:
    prompts = make_prompts(seed=22)[2:6]  # 17, 40, 64 and 100 tokens: chunks of 16
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=4 if i % 2 else None)
        for i in range(len(prompts))
    ]
    sync, ahead = _sync_and_async(llama_dir, prompts, params, max_num_batched_tokens=16)
    assert _samples(ahead) == _samples(sync)
    for i, (prompt, out) in enumerate(zip(prompts, ahead, strict=True)):
        if i % 2:
            assert_matches_transformers(llama_dir, prompt, out.prompt_logprobs, 4)
        else:
            assert out.prompt_logprobs is None


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_structured_outputs_equal_sync(llama_dir: Path, temperature: float) -> None:
    """Each grammar's mask is taken from its state after the step before's token."""
    prompts = make_prompts(seed=21)[:6]
    specs: list[StructuredOutputSpec | None] = [*SPECS.values(), None, None]
    params = [
        SamplingParams(temperature=temperature, max_tokens=24, seed=i, n=2, structured_outputs=spec)
        for i, spec in enumerate(specs)
    ]
    sync, ahead = _sync_and_async(llama_dir, prompts, params)
    assert _samples(ahead) == _samples(sync)


# ---------------------------------------------------------------- the engine directly


def test_an_abort_while_its_step_is_in_flight(llama_dir: Path) -> None:
    """A request aborted while the step ahead computes its next token gets no token more;
    the others, and one added after the abort (taking the freed blocks), are unchanged."""
    prompts = make_prompts(seed=1)
    expected = reference(llama_dir, prompts, "plain")
    engine = _llm(llama_dir).engine
    log = StepLog(engine)
    num_free_blocks = engine.block_manager.num_free_blocks
    chosen = (0, 2, 4, 6)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in chosen}
    finished: dict[str, RequestOutput] = {}

    def step() -> None:
        result = engine.step()
        for event in result.new_tokens:
            tokens[event.request_id].append(event.token_id)
        finished.update((o.request_id, o) for o in result.finished)

    for i in chosen:
        params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LENGTHS[i])
        engine.add_request(f"r{i}", prompts[i], params)
    for _ in range(4):
        step()
    in_flight = log.outputs_of("launch")[-1]
    assert all(output is not in_flight for output in log.outputs_of("update"))
    assert any(e.seq.request_id == "r4" and e.awaits_sampled_token for e in in_flight.scheduled)
    engine.abort_request("r4")
    num_delivered = len(tokens["r4"])
    late = make_prompts(seed=7)[4]
    tokens["late"] = []
    engine.add_request("late", late, SamplingParams(temperature=0.0, max_tokens=12))
    while engine.has_unfinished_requests():
        step()
    assert tokens["r4"] == expected[4][:num_delivered] and "r4" not in finished
    for i in (0, 2, 6):
        assert finished[f"r{i}"].outputs[0].token_ids == tokens[f"r{i}"] == expected[i]
    assert finished["late"].outputs[0].token_ids == hf_greedy(llama_dir, late, 12)
    assert engine.block_manager.num_free_blocks == num_free_blocks
    assert engine.block_manager.usage == 0.0
    log.assert_ran_ahead()


def test_the_next_step_is_launched_before_the_step_before_is_applied(llama_dir: Path) -> None:
    prompts = make_prompts(seed=4)[:6]
    shapes = [(24, 1), (1, 1), (2, 2), (3, 1), (24, 3), (12, 1)]  # max_tokens, n
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, n=n, ignore_eos=True) for m, n in shapes
    ]
    logs: dict[bool, StepLog] = {}
    outputs: dict[bool, list[RequestOutput]] = {}
    for async_scheduling in (False, True):
        llm = _llm(llama_dir, async_scheduling=async_scheduling)
        logs[async_scheduling] = StepLog(llm.engine)
        outputs[async_scheduling] = llm.generate(prompts, params)
    assert _samples(outputs[True]) == _samples(outputs[False])
    sync, ahead = logs[False], logs[True]
    assert not sync.outputs_of("schedule-ahead")
    assert sync.num_overlapped_updates() == sync.num_awaited_entries == 0
    assert sync.num_stale_samples() == 0
    ahead.assert_ran_ahead()
    # decode-heavy: nearly every step is applied after the next one is launched
    num_steps = len(ahead.outputs_of("update"))
    assert ahead.num_overlapped_updates() >= num_steps - 4
    kinds = [kind for kind, output in ahead.events if not output.is_empty]
    assert "schedule-ahead launch update" in " ".join(kinds)


# ---------------------------------------------------------------- disaggregated, refused configs


def test_prefill_hands_off_to_decode_as_transformers(llama_dir: Path) -> None:
    prompts = make_prompts(seed=1)
    expected = reference(llama_dir, prompts, "plain")
    prefill = _llm(llama_dir, max_num_batched_tokens=64).engine
    decode = _llm(llama_dir, num_kv_blocks=200).engine
    prefill_log, decode_log = StepLog(prefill), StepLog(decode)
    handed, finished = _prefill_all(prefill, prompts, greedy_params())
    # prompt chunks run ahead; a prefill-only sequence waits for the token it hands off on
    assert prefill_log.num_overlapped_updates() > 0
    assert prefill_log.num_awaited_entries == prefill_log.num_stale_samples() == 0
    assert [o.request_id for o in finished] == ["r3"]  # max_tokens=1 ends on the prefill side
    assert finished[0].outputs[0].token_ids == expected[3]
    outputs = _decode_all(prefill, decode, handed, transfer=True)
    assert outputs == {f"r{i}": [expected[i]] for i in range(len(prompts)) if i != 3}
    assert prefill.block_manager.usage == decode.block_manager.usage == 0.0
    decode_log.assert_ran_ahead()


def test_seeded_samples_split_across_engines_equal_one_sync_engine(llama_dir: Path) -> None:
    prompts = make_prompts(seed=12)[2:6]
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, n=3, seed=40 + i)
        for i in range(len(prompts))
    ]
    colocated = _llm(llama_dir, async_scheduling=False).generate(prompts, params)
    prefill, decode = _llm(llama_dir).engine, _llm(llama_dir).engine
    decode_log = StepLog(decode)
    handed, _ = _prefill_all(prefill, prompts, params)
    outputs = _decode_all(prefill, decode, handed, transfer=True)
    assert outputs == {f"r{i}": [c.token_ids for c in o.outputs] for i, o in enumerate(colocated)}
    decode_log.assert_ran_ahead()


def test_speculative_decoding_is_refused(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"async_scheduling.*speculative"):
        _llm(llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
