"""The scheduler with a draft proposer, synthetic tokens and a fake model: drafts take budget
and slots, go before anyone is preempted, stop at max tokens, and the drafts that fall leave
no trace in the sequence or the prefix cache."""

from __future__ import annotations

from engine.kv_cache.block_manager import BlockManager
from engine.sampling import SamplingParams
from engine.scheduler import ModelRunnerOutput, Scheduler, SchedulerConfig, SchedulerOutput
from engine.scheduler.outputs import AcceptedDrafts
from engine.sequence import Sequence
from engine.speculative.config import SpeculativeConfig
from engine.speculative.ngram import NgramProposer
from engine.step_timings import roofline_counts, step_timing

EOS = 2


CYCLE = (5, 6, 7, 8, 9, 10)


def successor(token: int) -> int:
    """A fake model: the token after ``token`` is the next one of CYCLE, round and round."""
    return CYCLE[(CYCLE.index(token) + 1) % len(CYCLE)] if token in CYCLE else CYCLE[0]


def fake_run(output: SchedulerOutput, wrong_from: int | None = None) -> ModelRunnerOutput:
    """Greedy checking against ``successor``; ``wrong_from``: drafts from that index on fall
    (the model 'chooses' token 3 there)."""
    sampled: dict[int, int] = {}
    accepted: dict[int, AcceptedDrafts] = {}
    for entry in output.scheduled:
        seq = entry.seq
        if not entry.draft_token_ids:
            for target in entry.sample_seqs:
                sampled[target.seq_id] = successor(target.token_ids[-1])
            continue
        stood: list[int] = []
        last = seq.token_ids[-1]
        for index, draft in enumerate((*entry.draft_token_ids, None)):
            choice = successor(last) if wrong_from is None or index < wrong_from else 3
            if draft is None or draft != choice:
                sampled[seq.seq_id] = choice
                break
            stood.append(draft)
            last = draft
        accepted[seq.seq_id] = AcceptedDrafts(
            stood, [None] * len(stood), len(entry.draft_token_ids)
        )
    return ModelRunnerOutput(sampled, accepted_drafts=accepted)


def make_scheduler(
    num_blocks: int = 64, block_size: int = 4, max_num_batched_tokens: int = 64, k: int = 4
) -> Scheduler:
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    proposer = NgramProposer(SpeculativeConfig(k, prompt_lookup_max=3, prompt_lookup_min=1))
    return Scheduler(SchedulerConfig(8, max_num_batched_tokens), manager, [EOS], proposer)


def add(scheduler: Scheduler, prompt: list[int], max_tokens: int) -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seq = Sequence(scheduler.new_seq_id(), "r", prompt, params, len(prompt) + max_tokens)
    scheduler.add(seq)
    return seq


def test_drafts_that_stand_advance_the_sequence_several_tokens_a_step() -> None:
    scheduler = make_scheduler()
    prompt = [5, 6, 7, 8, 9, 10, 5, 6]  # the model repeats it: 7 8 9 10 5 6 7 ...
    seq = add(scheduler, prompt, max_tokens=12)
    capped = add(scheduler, prompt, max_tokens=3)  # room for 1 draft after its first token
    steps = []
    while scheduler.num_unfinished:
        out = scheduler.schedule()
        steps.append([(e.num_new_tokens, e.draft_token_ids) for e in out.scheduled if e.seq is seq])
        for entry in out.scheduled:
            if entry.seq is capped and entry.num_new_tokens == 1:
                assert entry.draft_token_ids == (8,)
        assert out.num_batched_tokens == sum(e.num_query_tokens for e in out.scheduled)
        scheduler.update(out, fake_run(out))
    assert seq.output_token_ids == [7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6]
    assert capped.output_token_ids == [7, 8, 9]
    # the prompt, then 1 + 4 drafts a step; the last token has no room for a draft after it
    assert steps == [[(8, ())], [(1, (8, 9, 10, 5))], [(1, (7, 8, 9, 10))], [(1, ())]]
    assert seq.finish_reason == "length"
    # asked for drafts: seq twice (not for the prompt, nor without room for one), capped once
    assert scheduler.num_draft_attempts == 3


def test_a_lookup_that_finds_nothing_is_an_attempt_without_drafts() -> None:
    """pdserve:spec_decode_num_draft_attempts counts the times a decoding sequence asked, found
    drafts or not (the share with drafts is what ``pdserve plan --draft-rate`` takes)."""
    scheduler = make_scheduler()
    # after 9 and after 10 it asks (neither seen before); after 5 no draft has room
    seq = add(scheduler, [5, 6, 7, 8], max_tokens=4)
    while scheduler.num_unfinished:
        out = scheduler.schedule()
        assert all(not e.draft_token_ids for e in out.scheduled)
        scheduler.update(out, fake_run(out))
    assert seq.output_token_ids == [9, 10, 5, 6]
    assert scheduler.num_draft_attempts == 2


def test_drafts_that_fall_are_not_kept_and_their_slots_are_written_over() -> None:
    scheduler = make_scheduler(block_size=4)
    prompt = [5, 6, 7, 8, 9, 10, 5, 6]
    seq = add(scheduler, prompt, max_tokens=6)
    out = scheduler.schedule()
    scheduler.update(out, fake_run(out))  # the prompt; token 7
    out = scheduler.schedule()
    assert out.scheduled[0].draft_token_ids == (8, 9, 10, 5)
    scheduler.update(out, fake_run(out, wrong_from=2))  # 8 and 9 stand, then 3 is chosen
    assert seq.output_token_ids == [7, 8, 9, 3]
    assert seq.num_computed_tokens == seq.num_tokens - 1
    # the prompt's two blocks and the one of "7 8 9 3" (positions 8-11) are full; the slot of
    # the fallen draft "10" at position 11 holds "3" once it is computed, so that block is not
    # committed before
    assert seq.num_committed_blocks == 2
    out = scheduler.schedule()
    assert out.scheduled[0].start_position == 11  # the token "3" is computed where "10" was


def test_a_sequence_short_of_blocks_drops_its_drafts_before_anyone_is_preempted() -> None:
    # 4 blocks of 4, one held elsewhere: the prompt of 8 fills 2 blocks; its token and 4
    # drafts (positions 8-12) would need 2 more, and 1 is free
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    scheduler.block_manager.pool.allocate()
    seq = add(scheduler, [5, 6, 7, 8, 9, 10, 5, 6], max_tokens=8)
    out = scheduler.schedule()
    scheduler.update(out, fake_run(out))
    out = scheduler.schedule()
    assert out.num_preempted == 0
    assert out.scheduled[0].draft_token_ids == ()
    scheduler.update(out, fake_run(out))
    assert seq.output_token_ids == [7, 8]


def test_drafts_take_only_the_budget_left() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=3)
    seq = add(scheduler, [5, 6, 5], max_tokens=10)
    while seq.num_computed_tokens < 3:
        out = scheduler.schedule()
        scheduler.update(out, fake_run(out))
    out = scheduler.schedule()
    (entry,) = out.scheduled
    assert entry.num_query_tokens == 3 and len(entry.draft_token_ids) == 2
    # each of its 3 rows reads positions 0-3 as a worker reports it; its KV, positions 0-5
    # once the drafts' are written, is read once (pdserve plan's roofline)
    assert step_timing(out, 0.0).decode_context_tokens == 3 * 4
    assert roofline_counts(out)[0] == 3 + 3


def test_no_drafts_while_more_sequences_run_than_disable_by_batch_size() -> None:
    manager = BlockManager(64, 4, enable_prefix_caching=True)
    config = SpeculativeConfig(4, prompt_lookup_max=3, prompt_lookup_min=1, disable_by_batch_size=1)
    scheduler = Scheduler(SchedulerConfig(8, 64), manager, [EOS], NgramProposer(config))
    first = add(scheduler, [5, 6, 7, 8, 9, 10, 5, 6], max_tokens=12)
    second = add(scheduler, [5, 6, 7, 8, 9, 10, 5, 6], max_tokens=2)
    drafted: list[bool] = []
    while scheduler.num_unfinished:
        out = scheduler.schedule()
        if all(e.num_new_tokens == 1 for e in out.scheduled):
            drafted.append(any(e.draft_token_ids for e in out.scheduled))
        scheduler.update(out, fake_run(out))
    # two running: no drafts until the second finishes after its two tokens
    assert drafted[0] is False and all(drafted[1:])
    assert first.output_token_ids == [7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6]
    assert second.output_token_ids == [7, 8]
