"""The scheduler ahead of an unapplied step (async scheduling), with the fake model of
test_scheduler: the same tokens as scheduling in step, awaited tokens, held sequences, no
preemption ahead."""

from __future__ import annotations

import pytest

from engine.sampling import SamplingParams
from engine.scheduler import ModelRunnerOutput, SchedulerOutput, Sequence
from engine.scheduler.outputs import AWAITED_TOKEN_PLACEHOLDER
from tests.engine.test_scheduler import Harness, expected_output, fake_next_token


def sample(output: SchedulerOutput) -> ModelRunnerOutput:
    """The fake model's tokens for a step, drawn once the step before it is applied (as the
    runner samples): an awaited token is in the sequence by then."""
    sampled = {}
    for entry in output.scheduled:
        if entry.awaits_sampled_token:
            assert entry.seq.num_tokens == entry.start_position + 1
        for target in entry.sample_seqs:
            sampled[target.seq_id] = fake_next_token(target)
    return ModelRunnerOutput(sampled)


def run_ahead_to_completion(h: Harness, max_steps: int = 1000) -> list[SchedulerOutput]:
    """As the engine's async step: schedule the next step before applying the one in flight;
    an empty schedule ahead means the next one is scheduled after the update."""
    scheduler = h.scheduler
    in_flight = scheduler.schedule()
    scheduler.commit_launched(in_flight)
    steps = [in_flight]
    for _ in range(max_steps):
        if in_flight.is_empty:
            if not scheduler.num_unfinished:
                return steps
            in_flight = scheduler.schedule()
            scheduler.commit_launched(in_flight)
            steps.append(in_flight)
            continue
        result = sample(in_flight)
        ahead = scheduler.schedule(step_in_flight=True)
        assert ahead.num_preempted == 0
        scheduler.commit_launched(ahead)
        scheduler.update(in_flight, result)
        if not ahead.is_empty:
            h.check_invariants(ahead)
        in_flight = ahead
        steps.append(ahead)
    raise AssertionError("scheduler did not finish")


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"max_num_batched_tokens": 8},  # chunked prefills, ahead of one another
        {"num_blocks": 12, "max_num_batched_tokens": 16},  # short of blocks: preemptions
    ],
)
def test_scheduling_ahead_gives_every_sequence_its_own_tokens(config: dict[str, int]) -> None:
    h = Harness(**config)
    requests = [([7, 8, 9, 10, 11][: 1 + i % 5] * (1 + i), 3 + 2 * i) for i in range(6)]
    seqs = [h.add(prompt, max_tokens) for prompt, max_tokens in requests]
    steps = run_ahead_to_completion(h)
    for seq, (prompt, max_tokens) in zip(seqs, requests, strict=True):
        assert seq.output_token_ids == expected_output(prompt, max_tokens)
        assert seq.num_pending_tokens == 0
    assert any(e.awaits_sampled_token for step in steps for e in step.scheduled)
    assert h.manager.num_free_blocks == h.manager.pool.num_blocks
    if "num_blocks" in config:
        assert h.scheduler.num_preemptions > 0  # done by the schedules after an update


def test_an_entry_ahead_awaits_the_token_the_step_in_flight_samples() -> None:
    h = Harness()
    seq = h.add([5, 6, 7], max_tokens=4)
    first = h.scheduler.schedule()
    assert seq.num_pending_tokens == 1 and seq.num_computed_tokens == 3
    ahead = h.scheduler.schedule(step_in_flight=True)
    (entry,) = ahead.scheduled
    assert entry.awaits_sampled_token and entry.start_position == 3 and entry.num_new_tokens == 1
    assert entry.query_token_ids() == [AWAITED_TOKEN_PLACEHOLDER]
    assert entry.newest_token_id == AWAITED_TOKEN_PLACEHOLDER
    assert seq.num_pending_tokens == 2 and seq.num_computed_tokens == 4
    h.scheduler.update(first, sample(first))
    assert seq.num_tokens == 4 and seq.num_pending_tokens == 1


def test_a_sequence_one_token_short_of_its_limit_is_held() -> None:
    """Its pending token ends it: a step ahead would compute a token past max_tokens."""
    h = Harness()
    seq = h.add([5, 6, 7], max_tokens=2)
    first = h.scheduler.schedule()
    second = h.scheduler.schedule(step_in_flight=True)  # the token after the first may run
    assert [e.seq for e in second.scheduled] == [seq]
    h.scheduler.update(first, sample(first))
    assert h.scheduler.schedule(step_in_flight=True).is_empty  # its second token is its last
    h.scheduler.update(second, sample(second))
    assert seq.is_finished and seq.finish_reason == "length" and seq.num_output_tokens == 2


def test_a_prefill_only_sequence_is_held_for_its_hand_off() -> None:
    h = Harness()
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    seq = Sequence(h.scheduler.new_seq_id(), "p", [5, 6, 7], params, 11, prefill_only=True)
    h.scheduler.add(seq)
    first = h.scheduler.schedule()
    assert h.scheduler.schedule(step_in_flight=True).is_empty
    h.scheduler.update(first, sample(first))
    assert seq.status.value == "handed_off" and seq.num_output_tokens == 1


def test_a_request_of_n_samples_is_held_until_it_forks() -> None:
    h = Harness()
    parent = h.add([5, 6, 7, 8, 9], max_tokens=3, n=3)
    first = h.scheduler.schedule()
    assert h.scheduler.schedule(step_in_flight=True).is_empty  # its children come at update
    h.scheduler.update(first, sample(first))
    assert len(h.scheduler.running) == 3
    steps = run_ahead_to_completion(h)
    assert len(steps) > 1
    for seq in [parent, *h.scheduler.running]:
        assert seq.output_token_ids == expected_output([5, 6, 7, 8, 9], 3, seq.sample_index)


def test_short_of_blocks_ahead_the_schedule_is_empty_and_nobody_is_preempted() -> None:
    """Preempting a sequence whose step is in flight would free blocks it is writing; the
    schedule after the update preempts instead."""
    h = Harness(num_blocks=3, block_size=4)
    seqs = [h.add([5, 6, 7, 8], max_tokens=6), h.add([9, 10, 11, 12], max_tokens=6)]
    first = h.scheduler.schedule()  # a block each; each next token needs a new block
    ahead = h.scheduler.schedule(step_in_flight=True)
    assert ahead.is_empty and ahead.num_preempted == 0
    assert h.scheduler.num_preemptions == 0 and all(s in h.scheduler.running for s in seqs)
    h.scheduler.update(first, sample(first))
    assert h.scheduler.schedule().num_preempted == 1


def test_blocks_enter_the_prefix_cache_once_the_step_that_fills_them_is_launched() -> None:
    """A prompt admitted ahead finds the blocks the step in flight fills (the device runs it
    first); a block whose last token is still being sampled waits for that token."""
    h = Harness(block_size=4)
    seq = h.add([5, 6, 7, 8, 9, 10, 11], max_tokens=4)
    first = h.scheduler.schedule()
    assert seq.num_committed_blocks == 0  # scheduled, not launched
    h.scheduler.commit_launched(first)
    assert seq.num_committed_blocks == 1  # tokens 0-3; 4-6 fill half of the next block
    twin = h.add([5, 6, 7, 8, 9, 10, 11, 12], max_tokens=2)
    second = h.scheduler.schedule(step_in_flight=True)
    assert twin.num_cached_prompt_tokens == 4  # the in-flight step's block
    h.scheduler.commit_launched(second)  # seq's position 7: its token is not drawn yet
    assert seq.num_committed_blocks == 1
    h.scheduler.update(first, sample(first))
    h.scheduler.update(second, sample(second))
    assert seq.num_committed_blocks == 2
