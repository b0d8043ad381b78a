"""Scheduler with synthetic tokens and a fake model: batching, chunking, preemption, forks."""

from __future__ import annotations

import itertools

import pytest

from engine.kv_cache.block_manager import BlockManager, num_blocks_for
from engine.sampling import SamplingParams
from engine.scheduler import (
    ModelRunnerOutput,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    Sequence,
)

EOS = 2
VOCAB = 50


def fake_next_token(seq: Sequence) -> int:
    """A deterministic 'model': the next token depends only on the sequence so far."""
    return 3 + (sum(seq.token_ids) * 31 + seq.num_tokens + 7 * seq.sample_index) % (VOCAB - 3)


def fake_run(output: SchedulerOutput) -> ModelRunnerOutput:
    sampled = {}
    for entry in output.scheduled:
        assert entry.start_position + entry.num_new_tokens == entry.seq.num_computed_tokens
        for target in entry.sample_seqs:
            sampled[target.seq_id] = fake_next_token(target)
    return ModelRunnerOutput(sampled)


class Harness:
    def __init__(self, num_blocks: int = 64, block_size: int = 4, **config: int | bool) -> None:
        self.manager = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
        self.scheduler = Scheduler(SchedulerConfig(**config), self.manager, [EOS])  # type: ignore[arg-type]
        self.ids = itertools.count()

    def add(
        self,
        prompt: list[int],
        max_tokens: int,
        n: int = 1,
        seed: int | None = None,
        priority: int = 0,
    ) -> Sequence:
        params = SamplingParams(max_tokens=max_tokens, n=n, seed=seed, ignore_eos=True)
        seq = Sequence(
            self.scheduler.new_seq_id(),
            f"r{next(self.ids)}",
            prompt,
            params,
            len(prompt) + max_tokens,
            seed=seed,
            priority=priority,
        )
        self.scheduler.add(seq)
        return seq

    def add_received(self, prompt: list[int], max_tokens: int, n: int = 1) -> list[Sequence]:
        """Queue a request's n samples as a decode engine does once the prompt's KV arrived:
        every sample shares the prompt's blocks and holds the first token the prefill side
        sampled."""
        num_blocks = num_blocks_for(len(prompt), self.manager.block_size)
        block_ids = [self.manager.pool.allocate() for _ in range(num_blocks)]
        params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True)
        request_id = f"r{next(self.ids)}"
        samples = []
        for index in range(n):
            seq = Sequence(
                self.scheduler.new_seq_id(),
                request_id,
                prompt,
                params,
                len(prompt) + max_tokens,
                sample_index=index,
            )
            self.manager.adopt(seq, block_ids, share=index > 0)
            seq.token_ids.append(fake_next_token(seq))
            self.scheduler.add_computed(seq)
            samples.append(seq)
        return samples

    def run_to_completion(self, max_steps: int = 1000) -> list[SchedulerOutput]:
        outputs = []
        for _ in range(max_steps):
            if not self.scheduler.num_unfinished:
                return outputs
            out = self.scheduler.schedule()
            self.check_invariants(out)
            self.scheduler.update(out, fake_run(out))
            outputs.append(out)
        raise AssertionError("scheduler did not finish")

    def check_invariants(self, out: SchedulerOutput) -> None:
        cfg = self.scheduler.config
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert sum(e.num_new_tokens for e in out.scheduled) == out.num_batched_tokens
        assert len(self.scheduler.running) <= cfg.max_num_seqs
        seq_ids = [e.seq.seq_id for e in out.scheduled]
        assert len(seq_ids) == len(set(seq_ids))
        for entry in out.scheduled:
            covered = len(entry.seq.block_tables[0]) * self.manager.block_size
            assert covered >= entry.start_position + entry.num_new_tokens


def expected_output(prompt: list[int], max_tokens: int, sample_index: int = 0) -> list[int]:
    seq = Sequence(0, "x", prompt, SamplingParams(), 10**6, sample_index=sample_index)
    for _ in range(max_tokens):
        seq.token_ids.append(fake_next_token(seq))
    return seq.output_token_ids


def test_continuous_batching_gives_each_sequence_its_own_tokens() -> None:
    harness = Harness(max_num_seqs=4, max_num_batched_tokens=64)
    prompts = [[5 + i] * (3 + 5 * i) for i in range(7)]
    seqs = [harness.add(p, max_tokens=5 + i) for i, p in enumerate(prompts)]
    outputs = harness.run_to_completion()
    for i, seq in enumerate(seqs):
        assert seq.output_token_ids == expected_output(prompts[i], 5 + i)
        assert seq.finish_reason == "length"
    # later requests joined while earlier ones were decoding
    assert any({e.num_new_tokens > 1 for e in out.scheduled} == {True, False} for out in outputs)
    assert harness.manager.num_free_blocks == 64


def test_chunked_prefill_respects_token_budget() -> None:
    harness = Harness(max_num_batched_tokens=8)
    seq = harness.add(list(range(3, 30)), max_tokens=3)
    outputs = harness.run_to_completion()
    chunks = [e.num_new_tokens for out in outputs for e in out.scheduled]
    assert chunks[:4] == [8, 8, 8, 3]
    assert not outputs[0].scheduled[0].sample_seqs  # a partial chunk samples nothing
    assert seq.output_token_ids == expected_output(list(range(3, 30)), 3)


def test_without_chunked_prefill_long_prompt_waits_for_a_whole_step() -> None:
    harness = Harness(max_num_batched_tokens=16, enable_chunked_prefill=False)
    harness.add([3] * 4, max_tokens=20)
    harness.add([4] * 16, max_tokens=2)
    outputs = harness.run_to_completion()
    assert all(e.num_new_tokens in (1, 4, 16) for out in outputs for e in out.scheduled)


def test_max_num_seqs_caps_running_batch() -> None:
    harness = Harness(max_num_seqs=2)
    for i in range(5):
        harness.add([3 + i] * 4, max_tokens=4)
    outputs = harness.run_to_completion()
    assert max(len(out.scheduled) for out in outputs) == 2


def test_max_num_seqs_counts_the_samples_a_prefilling_request_will_fork_into() -> None:
    """Two n = 3 requests under max_num_seqs 4: the second waits until the first is done, also
    when the first's prompt is still being prefilled (as one sequence) when it arrives."""
    harness = Harness(max_num_seqs=4, max_num_batched_tokens=16)
    first = harness.add(list(range(3, 15)), max_tokens=5, n=3)
    second = harness.add(list(range(20, 32)), max_tokens=5, n=3)
    most_running = 0
    while harness.scheduler.num_unfinished:
        out = harness.scheduler.schedule()
        harness.scheduler.update(out, fake_run(out))
        most_running = max(most_running, len(harness.scheduler.running))
    assert most_running == 3
    assert first.output_token_ids == expected_output(list(range(3, 15)), 5)
    assert second.output_token_ids == expected_output(list(range(20, 32)), 5)


def test_out_of_blocks_preempts_newest_and_recomputes_same_tokens() -> None:
    harness = Harness(num_blocks=10, block_size=4)
    prompts = [[3 + i] * 6 for i in range(4)]
    seqs = [harness.add(p, max_tokens=12) for p in prompts]
    outputs = harness.run_to_completion()
    assert harness.scheduler.num_preemptions > 0
    assert sum(out.num_preempted for out in outputs) == harness.scheduler.num_preemptions
    assert max(s.num_preemptions for s in seqs[1:]) > 0
    assert seqs[0].num_preemptions == 0  # the oldest is never the victim while others run
    for prompt, seq in zip(prompts, seqs):
        assert seq.output_token_ids == expected_output(prompt, 12)
    assert harness.manager.num_free_blocks == 10


def test_parallel_samples_fork_after_prompt_and_share_its_blocks() -> None:
    harness = Harness(block_size=4)
    prompt = list(range(3, 13))  # 10 tokens: 2 full blocks + a partial one
    parent = harness.add(prompt, max_tokens=4, n=3, seed=1)
    out = harness.scheduler.schedule()
    (entry,) = out.scheduled
    assert [s.sample_index for s in entry.sample_seqs] == [0, 1, 2]
    children = entry.sample_seqs[1:]
    assert children[0].seed != children[1].seed
    harness.scheduler.update(out, fake_run(out))
    assert all(c.block_tables[0] == parent.block_tables[0] for c in children)
    out = harness.scheduler.schedule()
    assert len(out.block_copies) == 2  # two of three samples copy the shared partial block
    harness.scheduler.update(out, fake_run(out))
    harness.run_to_completion()
    for seq in (parent, *children):
        assert seq.output_token_ids == expected_output(prompt, 4, seq.sample_index)
    assert harness.manager.num_free_blocks == 64


def test_abort_frees_blocks_and_removes_sequences() -> None:
    harness = Harness()
    seq = harness.add(list(range(3, 20)), max_tokens=50)
    out = harness.scheduler.schedule()
    harness.scheduler.update(out, fake_run(out))
    assert harness.scheduler.abort(seq.request_id) == [seq]
    assert seq.finish_reason == "abort"
    assert harness.scheduler.num_unfinished == 0
    assert harness.manager.usage == 0.0


def test_request_larger_than_cache_is_refused() -> None:
    harness = Harness(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="KV cache"):
        harness.add([3] * 10, max_tokens=10)


def test_more_parallel_samples_than_max_num_seqs_is_refused() -> None:
    harness = Harness(max_num_seqs=2)
    with pytest.raises(ValueError, match="max_num_seqs"):
        harness.add([3] * 4, max_tokens=4, n=3)


def test_received_kv_waits_holding_its_blocks_and_is_never_recomputed() -> None:
    """Two samples arrive with their 6-token prompt's KV (a full block and a partial one,
    shared) while a running sequence holds the other 4 blocks. The first sample needs a block
    to copy the shared partial one into: it waits, blocks held, until the running one is done.
    Had it given them back, this decode engine would have computed its prompt again."""
    harness = Harness(num_blocks=6, block_size=4)
    running = harness.add(list(range(3, 18)), max_tokens=2)  # 4 blocks for its 16 tokens
    out = harness.scheduler.schedule()
    harness.scheduler.update(out, fake_run(out))
    prompt = list(range(20, 26))
    samples = harness.add_received(prompt, max_tokens=5, n=2)
    assert harness.manager.num_free_blocks == 0
    outputs = harness.run_to_completion()
    assert samples[0] not in [e.seq for e in outputs[0].scheduled]  # it waited
    for out in outputs:
        for entry in out.scheduled:
            if entry.seq in samples:
                assert entry.start_position >= len(prompt) and entry.num_new_tokens == 1
    assert harness.scheduler.num_preemptions == 0
    assert running.output_token_ids == expected_output(list(range(3, 18)), 2)
    for seq in samples:
        assert seq.output_token_ids == expected_output(prompt, 5, seq.sample_index)
    assert harness.manager.num_free_blocks == 6


def _two_decodes_then_received(harness: Harness, received_prompt: list[int]) -> list[Sequence]:
    """Two sequences of 4 prompt tokens decode (a block each so far, 4 each at the end), then
    a request for 3 tokens arrives with its prompt's KV. Returns the two and its sample."""
    decoding = [harness.add([3 + i] * 4, max_tokens=12) for i in range(2)]
    out = harness.scheduler.schedule()
    harness.scheduler.update(out, fake_run(out))
    return [*decoding, *harness.add_received(received_prompt, max_tokens=3)]


def test_received_kv_keeps_its_blocks_while_running_sequences_preempt_each_other() -> None:
    """The received prompt fills 2 blocks, so its next token needs a third; the two decoding
    sequences take the other 4 and run out. The newer one is preempted (not the received KV
    taken), the older decodes to its end, and only then the received sample runs, from its
    prompt's end."""
    harness = Harness(num_blocks=6, block_size=4)
    received_prompt = list(range(30, 38))
    older, newer, received = _two_decodes_then_received(harness, received_prompt)
    outputs = harness.run_to_completion()
    assert (older.num_preemptions, newer.num_preemptions, received.num_preemptions) == (0, 1, 0)
    steps = [(i, e) for i, out in enumerate(outputs) for e in out.scheduled]
    older_end = max(i for i, e in steps if e.seq is older)
    first_step, first = next((i, e) for i, e in steps if e.seq is received)
    assert first_step > older_end and first.start_position == len(received_prompt)
    for i, seq in enumerate((older, newer)):
        assert seq.output_token_ids == expected_output([3 + i] * 4, 12)
    assert received.output_token_ids == expected_output(received_prompt, 3)
    assert harness.manager.num_free_blocks == 6


def test_received_kv_waiting_gives_its_blocks_to_the_only_running_sequence() -> None:
    """As above, but the received prompt holds 3 blocks: once the newer decode is preempted, the
    older, running alone, still runs out. It takes the received KV's blocks rather than
    preempting itself (nothing else could give blocks back), and every sequence ends."""
    harness = Harness(num_blocks=6, block_size=4)
    received_prompt = list(range(30, 42))
    older, newer, received = _two_decodes_then_received(harness, received_prompt)
    for _ in range(20):  # until its blocks are taken, while it waits
        running = list(harness.scheduler.running)
        out = harness.scheduler.schedule()
        harness.scheduler.update(out, fake_run(out))
        if not received.block_tables:
            break
    assert running == [older] and out.scheduled[0].seq is older and out.num_preempted == 0
    assert newer.num_preemptions == 1 and received.num_preemptions == 1
    harness.run_to_completion()
    assert older.num_preemptions == 0
    for i, seq in enumerate((older, newer)):
        assert seq.output_token_ids == expected_output([3 + i] * 4, 12)
    assert received.output_token_ids == expected_output(received_prompt, 3)
    assert harness.manager.num_free_blocks == 6


def test_a_head_waiting_for_blocks_counts_its_prefix_hits_once() -> None:
    """A queued head whose cached prefix it attached does not fit gives it back and looks it up
    again at every step until it fits: its hits count once, when it is admitted (every try
    counted them, and the prefix cache served more tokens than the prompts had)."""
    harness = Harness(num_blocks=10, block_size=4)
    shared = list(range(10, 22))  # 3 full blocks
    harness.add(shared, max_tokens=1)
    harness.run_to_completion()
    pool = harness.manager.pool
    assert pool.num_cache_hits == 0
    harness.add(list(range(30, 50)), max_tokens=4)  # 5 blocks, 6 once it decodes
    out = harness.scheduler.schedule()
    harness.scheduler.update(out, fake_run(out))
    waiting = harness.add(shared + list(range(60, 76)), max_tokens=1)  # 7 blocks, 3 cached
    tries = 0
    while any(seq is waiting for seq in harness.scheduler.waiting):
        assert tries < 100, "the head was never admitted"
        out = harness.scheduler.schedule()
        harness.scheduler.update(out, fake_run(out))
        tries += 1
    assert tries > 2  # it waited for the running sequence to finish
    assert waiting.num_cached_prompt_tokens == 12
    assert pool.num_cache_hits == 3
    harness.run_to_completion()
