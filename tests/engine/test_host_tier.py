"""The host-memory tier's bookkeeping, pure Python: LRU order and slots, the swaps a step owes and
their order, prefix hits across the tiers (sliding windows too), preemption that comes back from
the host, and KV events that add up exactly to what the tiers hold after heavy churn.

The churn runs against ``SimulatedKV``: every device block and host slot holds, per offset, a
label naming the KV written there (its cache group and every token up to its position). Each
step moves blocks as the runner does (swap-outs, swap-ins, copy-on-write copies), writes the
labels of its tokens, and checks that every position its queries see holds its own label.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from engine.kv_cache.block_manager import RELEASED, BlockManager
from engine.kv_cache.cache_groups import CacheGroup, CacheGroups
from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.kv_events import KVEventLog, KVEventRecorder
from engine.sampling import SamplingParams
from engine.scheduler import ModelRunnerOutput, Scheduler, SchedulerConfig, SchedulerOutput
from engine.scheduler.outputs import ScheduledSequence
from engine.sequence import Sequence
from tests.engine.test_scheduler import EOS, expected_output, fake_next_token

A, B, C, D = (bytes([n]) * 16 for n in (1, 2, 3, 4))
Label = tuple[int, str | None, int]  # (cache group, salt, hash of the tokens up to it)


def _label(group: int, seq: Sequence, token_ids: list[int], position: int) -> Label:
    return group, seq.cache_salt, hash(tuple(token_ids[: position + 1]))


class SimulatedKV:
    """What each device block and host slot holds: offset -> label."""

    def __init__(self, num_blocks: int, num_host_slots: int, windows: tuple[int | None, ...]):
        self.device: list[dict[int, Label]] = [{} for _ in range(num_blocks)]
        self.host: list[dict[int, Label]] = [{} for _ in range(num_host_slots)]
        self.windows = windows
        self.num_checked = 0  # positions read back and found right

    def move(self, output: SchedulerOutput) -> None:
        """Swap-outs, then swap-ins, then copy-on-write copies, each a gather then a scatter."""
        outs = [(slot, dict(self.device[block])) for block, slot in output.swap_outs]
        for slot, content in outs:
            self.host[slot] = content
        ins = [(block, dict(self.host[slot])) for slot, block in output.swap_ins]
        for block, content in ins:
            self.device[block] = content
        copies = [(dst, dict(self.device[src])) for src, dst in output.block_copies]
        for block, content in copies:
            self.device[block] = content

    def forward(self, entries: list[ScheduledSequence], block_size: int) -> None:
        """Every entry's tokens written, then every position its queries see checked (a
        forward writes a layer's K/V before it attends)."""
        runs = []
        for entry in entries:
            seq = entry.seq
            if seq.is_finished:
                continue
            token_ids = list(seq.token_ids)
            if entry.awaits_sampled_token:  # the fake model's token, as the step before draws it
                token_ids.append(fake_next_token(seq))
            start, end = entry.start_position, entry.start_position + entry.num_new_tokens
            for group, table in enumerate(seq.block_tables):
                for position in range(start, end):
                    block = table[position // block_size]
                    label = _label(group, seq, token_ids, position)
                    self.device[block][position % block_size] = label
            runs.append((seq, token_ids, start, end))
        for seq, token_ids, start, end in runs:
            for group, table in enumerate(seq.block_tables):
                window = self.windows[group]
                first = 0 if window is None else max(0, start - window + 1)
                for position in range(first, end):
                    block = table[position // block_size]
                    assert block != RELEASED, (seq, group, position)
                    held = self.device[block].get(position % block_size)
                    assert held == _label(group, seq, token_ids, position), (seq, group, position)
                    self.num_checked += 1


def _manager(
    num_blocks: int,
    num_host_slots: int,
    recorder: KVEventRecorder | None = None,
    windows: tuple[int | None, ...] = (None,),
    block_size: int = 4,
) -> BlockManager:
    groups = CacheGroups(tuple(CacheGroup(w, (i,)) for i, w in enumerate(windows)))
    return BlockManager(
        num_blocks,
        block_size,
        enable_prefix_caching=True,
        cache_groups=groups,
        kv_events=recorder,
        num_host_slots=num_host_slots,
    )


def _seq(seq_id: int, tokens: list[int], max_tokens: int = 8, n: int = 1) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True)
    return Sequence(seq_id, f"r{seq_id}", tokens, params, len(tokens) + max_tokens)


# ---- the tier alone -------------------------------------------------------------------------
def test_the_tier_keeps_evicted_blocks_in_free_slots_then_in_its_least_recently_used() -> None:
    recorder = KVEventRecorder()
    tier = HostTier(2, recorder)
    tier.evicted(10, A)
    tier.evicted(11, B)
    assert tier.take_swaps() == (((10, 0), (11, 1)), ())
    tier.evicted(12, A)  # held already: no copy, and A is now the most recently used
    assert tier.take_swaps() == ((), ())
    tier.evicted(13, C)  # full: B, the least recently used, makes room
    assert tier.take_swaps() == (((13, 1),), ())
    assert (tier.slot_of(A), tier.slot_of(B), tier.slot_of(C)) == (0, None, 1)
    assert [(e.kind, e.block_hashes) for e in recorder.take()] == [
        ("stored", (A, B)),
        ("removed", (B,)),
        ("stored", (C,)),
    ]
    assert tier.cached_hashes() == {0: frozenset({A, C})}


def test_a_slot_read_this_step_is_not_reused_and_a_slot_reused_drops_its_copy() -> None:
    tier = HostTier(2)
    tier.evicted(10, A)
    tier.evicted(11, B)
    tier.take_swaps()
    slot = tier.pin(A)
    tier.swap_in(slot, 20)
    tier.evicted(12, C)  # B's slot, not A's: A is read this step
    tier.evicted(13, D)  # every other slot holds a block of this step: C's slot is reused
    assert tier.slot_of(A) == 0 and tier.slot_of(B) is None and tier.slot_of(C) is None
    assert tier.take_swaps() == (((13, 1),), ((0, 20),))
    tier.pin(A)  # both slots pinned: the next evicted block is not kept
    tier.pin(D)
    tier.evicted(14, B)
    assert tier.slot_of(B) is None and tier.take_swaps() == ((), ())


def test_a_block_brought_back_and_evicted_in_the_same_step_is_not_copied_either_way() -> None:
    tier = HostTier(4)
    tier.evicted(10, A)
    tier.take_swaps()
    tier.swap_in(tier.pin(A), 20)
    tier.evicted(20, A)  # block 20 goes to a new owner before A ever landed in it
    assert tier.take_swaps() == ((), ())
    assert tier.slot_of(A) == 0


# ---- the block manager over both tiers ------------------------------------------------------
def test_evicted_prefix_blocks_go_to_the_host_and_a_hit_there_swaps_them_back() -> None:
    recorder = KVEventRecorder()
    manager = _manager(4, 8, recorder)
    kv = SimulatedKV(4, 8, (None,))
    first = _seq(0, list(range(3, 14)))  # 11 tokens: two full blocks and a partial one
    _step(manager, kv, first, manager.attach_cached_prefix(first))
    manager.free(first)
    other = _seq(1, list(range(50, 66)))  # 16 tokens: all four blocks, evicting first's two
    _step(manager, kv, other, manager.attach_cached_prefix(other))
    assert manager.cached_block_hashes() == {
        ("device", 0): frozenset(other.block_hashes[:4]),
        ("host", 0): frozenset(first.block_hashes[:2]),
    }
    other_blocks = list(other.block_tables[0])
    manager.free(other)
    again = _seq(2, list(range(3, 14)))
    assert manager.attach_cached_prefix(again) == 8  # both full blocks, from the host
    swap_outs, swap_ins = manager.take_swaps()
    # the blocks they land in held other's newest two, which go to the host before
    assert swap_outs == ((other_blocks[3], 2), (other_blocks[2], 3))
    assert [block for _, block in swap_ins] == again.block_tables[0][:2]
    assert manager.pool.cached_block(again.block_hashes[0]) == again.block_tables[0][0]
    assert manager.host is not None and manager.host.num_hit_blocks == 2
    kv.move(SchedulerOutput([], [], 0, 0, swap_outs, swap_ins))
    _step(manager, kv, again, 8)  # reads the two blocks back: their labels came along
    log = KVEventLog()
    log.append(recorder.take())
    assert log.holdings() == manager.cached_block_hashes()


def test_the_device_prefix_continues_with_blocks_only_the_host_holds() -> None:
    manager = _manager(8, 8)
    seq = _seq(0, list(range(3, 20)))  # 17 tokens: four full blocks and a partial one
    _compute_all(manager, seq)
    hashes = seq.block_hashes[:4]
    manager.free(seq)
    head = [manager.pool.cached_block(h) for h in hashes[:2]]
    for block_id in head:  # kept from eviction while the others age out
        assert block_id is not None
        manager.pool.incref(block_id)
    filler = [manager.pool.allocate() for _ in range(6)]  # the 4 free, then the 2 cached
    swap_outs, _ = manager.take_swaps()
    assert len(swap_outs) == 2
    for block_id in head + filler:
        assert block_id is not None
        manager.pool.free(block_id)
    assert [manager.pool.cached_block(h) is None for h in hashes] == [False, False, True, True]
    again = _seq(1, list(range(3, 20)))
    assert manager.attach_cached_prefix(again) == 16
    assert again.block_tables[0][:2] == head
    _, swap_ins = manager.take_swaps()
    assert [block for _, block in swap_ins] == again.block_tables[0][2:4]
    assert manager.host is not None and manager.host.num_hit_blocks == 2


def test_a_host_hit_takes_no_more_blocks_than_the_device_has_free() -> None:
    manager = _manager(6, 16)
    seq = _seq(0, list(range(3, 24)))  # 21 tokens: five full blocks
    _compute_all(manager, seq)
    manager.free(seq)
    held = [manager.pool.allocate() for _ in range(6)]  # every block, cached ones evicted
    manager.take_swaps()
    for block_id in held[:3]:
        manager.pool.free(block_id)
    again = _seq(1, list(range(3, 24)))
    assert manager.attach_cached_prefix(again) == 12  # three free blocks: three blocks back
    assert len(manager.take_swaps()[1]) == 3


def test_a_windowed_group_brings_back_only_what_its_window_sees() -> None:
    """A full group and one of window 6 (blocks of 4): a 17-token prompt's next token sees
    positions 11 .. 16, so the windowed group takes blocks 2 and 3 alone."""
    manager = _manager(10, 16, windows=(None, 6))
    seq = _seq(0, list(range(3, 20)), max_tokens=2)
    _compute_all(manager, seq)
    manager.free(seq)
    held = [manager.pool.allocate() for _ in range(10)]
    manager.take_swaps()
    for block_id in held:
        manager.pool.free(block_id)
    again = _seq(1, list(range(3, 20)))
    assert manager.attach_cached_prefix(again) == 16
    _, swap_ins = manager.take_swaps()
    assert len(swap_ins) == 4 + 2
    assert again.block_tables[1][:2] == [RELEASED, RELEASED]


def test_a_preempted_sequence_comes_back_from_the_host_with_its_generated_blocks() -> None:
    """Blocks of 4, 10 of them on the device, 32 in the host tier: two sequences of 22 tokens
    (6 blocks each) decode until one preempts the other; the victim's full blocks (its output's
    too) go to the host as the other takes their blocks, and its readmission brings them back,
    not recomputing them."""
    manager = _manager(10, 32)
    kv = SimulatedKV(10, 32, manager.windows)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), manager, [EOS])
    prompts = [list(range(3, 9)), list(range(20, 26))]
    seqs = [_seq(i, p, max_tokens=16) for i, p in enumerate(prompts)]
    for seq in seqs:
        scheduler.add(seq)
    preempted_at: list[int] = []
    while scheduler.num_unfinished:
        out = scheduler.schedule()
        if out.num_preempted and not preempted_at:
            victim = seqs[1]
            assert not victim.block_tables
            preempted_at.append(victim.num_tokens)
            # every full block it computed, prompt and output, is cached
            num_full = (victim.num_tokens - 1) // 4
            hashes = manager.cached_block_hashes()
            held = hashes.get(("device", 0), frozenset()) | hashes.get(("host", 0), frozenset())
            assert set(victim.block_hashes[:num_full]) <= held
        _run_step(scheduler, kv, out)
    assert preempted_at and seqs[1].num_preemptions >= 1
    assert manager.host is not None and manager.host.num_hit_blocks > 0
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.output_token_ids == expected_output(prompt, 16)


def test_a_step_that_schedules_nothing_still_brings_back_the_blocks_it_attached() -> None:
    """A head finds its prefix in the host tier, takes three free blocks for it, and then does
    not fit: the step computes nothing, but the blocks stay cached under their hashes, so the
    step's swap-ins must still land; the next admission reads them from the device."""
    manager = _manager(8, 16)
    kv = SimulatedKV(8, 16, manager.windows)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), manager, [EOS])
    prompt = list(range(3, 16))  # 13 tokens: three full blocks
    scheduler.add(_seq(0, prompt, max_tokens=1))
    _run_in_step(scheduler, kv, lambda: None)
    held = [manager.pool.allocate() for _ in range(8)]  # the prompt's blocks go to the host
    for block_id in held[:3]:
        manager.pool.free(block_id)
    longer = _seq(1, prompt + list(range(40, 48)), max_tokens=1)  # 21 tokens: six blocks
    scheduler.add(longer)
    out = scheduler.schedule()
    assert out.is_empty and len(out.swap_outs) == 3 and len(out.swap_ins) == 3
    _run_step(scheduler, kv, out)
    for block_id in held[3:]:
        manager.pool.free(block_id)
    checked = kv.num_checked
    out = scheduler.schedule()
    assert out.scheduled[0].start_position == 12 and out.swap_ins == ()
    _run_step(scheduler, kv, out)
    assert kv.num_checked - checked == 21  # the 12 brought back, then the 9 computed
    _run_in_step(scheduler, kv, lambda: None)
    assert longer.output_token_ids == expected_output(longer.prompt_token_ids, 1)


# ---- churn ----------------------------------------------------------------------------------
def test_random_churn_of_the_block_manager_keeps_content_and_events_exact() -> None:
    """Thousands of lookups, allocations, commits and frees on 12 device blocks and 6 host
    slots: every block read back holds what was written, and the events add up to what the
    tiers hold after every step."""
    rng = random.Random(5)
    recorder, log = KVEventRecorder(), KVEventLog()
    manager = _manager(12, 6, recorder)
    kv = SimulatedKV(12, 6, (None,))
    families = [[rng.randrange(3, 50) for _ in range(24)] for _ in range(4)]
    held: list[Sequence] = []
    for step in range(2500):
        if held and (rng.random() < 0.5 or manager.num_free_blocks < 6):
            manager.free(held.pop(rng.randrange(len(held))))
        else:
            family = rng.choice(families)
            tokens = family[: rng.randrange(1, 24)] + [rng.randrange(3, 50)] * rng.randrange(3)
            seq = _seq(step, tokens)
            num_cached = manager.attach_cached_prefix(seq)
            if not manager.can_allocate(seq, seq.num_tokens - num_cached):
                manager.free(seq)
            else:
                _step(manager, kv, seq, num_cached)
                held.append(seq)
        log.append(recorder.take())
        assert log.holdings() == manager.cached_block_hashes()
    assert manager.host is not None and manager.host.num_hit_blocks > 100
    assert kv.num_checked > 10_000


StepHook = Callable[[], None]  # runs after every step: arrivals, the events' check
Runner = Callable[[Scheduler, SimulatedKV, StepHook], None]


def _run_in_step(scheduler: Scheduler, kv: SimulatedKV, after_step: StepHook) -> None:
    """Steps until nothing is left to run."""
    for _ in range(5000):
        if not scheduler.num_unfinished:
            return
        _run_step(scheduler, kv, scheduler.schedule())
        after_step()
    raise AssertionError("the scheduler did not finish")


def _run_ahead(scheduler: Scheduler, kv: SimulatedKV, after_step: StepHook) -> None:
    """As the engine's async step: the next step is scheduled and launched (its blocks moved
    and its tokens written, an awaited one as the step in flight draws it) before the step in
    flight is applied."""
    in_flight: SchedulerOutput | None = None
    for _ in range(5000):
        if in_flight is None:
            if not scheduler.num_unfinished:
                return
            in_flight = _launch(scheduler, kv, scheduler.schedule())
            if in_flight is None:
                after_step()
                continue
        result = _fake_sample(in_flight)
        ahead = _launch(scheduler, kv, scheduler.schedule(step_in_flight=True))
        scheduler.update(in_flight, result)
        after_step()
        in_flight = ahead
    raise AssertionError("the scheduler did not finish")


@pytest.mark.parametrize("runner", [_run_in_step, _run_ahead], ids=["in-step", "ahead"])
@pytest.mark.parametrize("windows", [(None,), (None, 7)], ids=["full", "full-and-window-7"])
def test_random_requests_through_the_scheduler_read_back_what_they_wrote(
    runner: Runner, windows: tuple[int | None, ...]
) -> None:
    """Requests sharing prefixes, some of two samples, arriving over time, on a device cache so
    small that they preempt each other and a host tier smaller still: each gets the fake
    model's tokens, every position read holds its KV, and the events stay exact."""
    rng = random.Random(11)
    recorder, log = KVEventRecorder(), KVEventLog()
    num_blocks = 16 * len(windows)
    manager = _manager(num_blocks, 10, recorder, windows)
    kv = SimulatedKV(num_blocks, 10, windows)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12)
    scheduler = Scheduler(config, manager, [EOS])
    families = [[rng.randrange(3, 50) for _ in range(30)] for _ in range(3)]
    requests = []
    for index in range(150):
        prompt = rng.choice(families)[: rng.randrange(2, 30)] + [rng.randrange(3, 50)]
        requests.append((prompt, rng.randrange(1, 20), 2 if index % 7 == 3 else 1))
    seqs: list[Sequence] = []

    def after_step() -> None:
        if len(seqs) < len(requests) and rng.random() < 0.5:
            prompt, max_tokens, n = requests[len(seqs)]
            seqs.append(_seq(scheduler.new_seq_id(), prompt, max_tokens, n))
            scheduler.add(seqs[-1])
        log.append(recorder.take())
        assert log.holdings() == manager.cached_block_hashes()

    while len(seqs) < len(requests) or scheduler.num_unfinished:
        after_step()
        runner(scheduler, kv, after_step)
    for seq in seqs:
        assert seq.output_token_ids == expected_output(
            seq.prompt_token_ids, seq.max_total_tokens - seq.num_prompt_tokens
        )
    assert scheduler.num_preemptions > 0
    assert manager.host is not None and manager.host.num_hit_blocks > 0
    assert manager.num_free_blocks == num_blocks
    assert kv.num_checked > 5000


# ---- helpers --------------------------------------------------------------------------------
def _step(manager: BlockManager, kv: SimulatedKV, seq: Sequence, num_cached: int) -> None:
    """Compute the rest of ``seq``'s tokens in one step: their blocks, the step's block moves,
    its writes and reads, then its full blocks committed."""
    num_new = seq.num_tokens - num_cached
    copies = manager.allocate_slots(seq, num_new)
    swap_outs, swap_ins = manager.take_swaps()
    entry = ScheduledSequence(seq, num_cached, num_new, ())
    kv.move(SchedulerOutput([entry], copies, num_new, 0, swap_outs, swap_ins))
    seq.num_computed_tokens += num_new
    kv.forward([entry], manager.block_size)
    manager.commit_computed(seq)


def _compute_all(manager: BlockManager, seq: Sequence) -> None:
    """Give ``seq`` blocks for all its tokens and commit them, content aside."""
    num_cached = manager.attach_cached_prefix(seq)
    manager.allocate_slots(seq, seq.num_tokens - num_cached)
    seq.num_computed_tokens = seq.num_tokens
    manager.commit_computed(seq)


def _fake_sample(output: SchedulerOutput) -> ModelRunnerOutput:
    """The fake model's token for every sample of the step, from its sequence as it is now."""
    return ModelRunnerOutput(
        {t.seq_id: fake_next_token(t) for e in output.scheduled for t in e.sample_seqs}
    )


def _run_step(scheduler: Scheduler, kv: SimulatedKV, output: SchedulerOutput) -> None:
    """A step as the engine runs it without async scheduling."""
    kv.move(output)
    kv.forward(output.scheduled, scheduler.block_manager.block_size)
    scheduler.update(output, _fake_sample(output))


def _launch(
    scheduler: Scheduler, kv: SimulatedKV, output: SchedulerOutput
) -> SchedulerOutput | None:
    """A step launched ahead: its block moves (made even when it computes nothing), its
    tokens written and read, its blocks committed; None when it computes nothing."""
    kv.move(output)
    if output.is_empty:
        return None
    kv.forward(output.scheduled, scheduler.block_manager.block_size)
    scheduler.commit_launched(output)
    return output
