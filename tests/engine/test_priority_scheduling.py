"""The scheduling policy "priority" (vLLM's ``scheduling_policy``): lower priority values run
first, then earlier arrivals; the lowest is preempted first; "fcfs" refuses a priority."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, LLMEngine, SamplingParams
from engine.messages import PrefillResult
from engine.scheduler import SchedulerConfig, Sequence
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_scheduler import Harness, expected_output, fake_run


def _finish_order(harness: Harness) -> list[Sequence]:
    order: list[Sequence] = []
    running = {s.seq_id: s for s in harness.scheduler.waiting}
    for out in harness.run_to_completion():
        running.update((e.seq.seq_id, e.seq) for e in out.scheduled)
        order += [s for s in running.values() if s.is_finished and s not in order]
    return order


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_one_at_a_time_they_run_by_priority_then_arrival(policy: str) -> None:
    harness = Harness(max_num_seqs=1, policy=policy)  # type: ignore[arg-type]
    priorities = [5, 0, 3, 0, -2] if policy == "priority" else [0] * 5
    seqs = [harness.add([7 + i] * 6, 4, priority=p) for i, p in enumerate(priorities)]
    order = _finish_order(harness)
    expected = [4, 1, 3, 2, 0] if policy == "priority" else [0, 1, 2, 3, 4]
    assert order == [seqs[i] for i in expected]
    for i, seq in enumerate(seqs):  # the order changes when, never what
        assert seq.output_token_ids == expected_output([7 + i] * 6, 4)


def test_the_lowest_priority_running_is_preempted_not_the_newest() -> None:
    """Three sequences fill the cache; the first admitted has the lowest priority (9). When
    the others need blocks, it is the one preempted, then recomputed: its tokens unchanged."""
    harness = Harness(num_blocks=12, block_size=4, max_num_seqs=3, policy="priority")  # type: ignore[arg-type]
    low = harness.add([3] * 12, 12, priority=9)
    high = [harness.add([4 + i] * 12, 12, priority=1) for i in range(2)]
    first = harness.scheduler.schedule()
    assert [e.seq for e in first.scheduled] == [*high, low]  # served in priority order
    harness.scheduler.update(first, fake_run(first))
    harness.run_to_completion()
    assert low.num_preemptions >= 1
    assert all(seq.num_preemptions == 0 for seq in high)
    assert low.output_token_ids == expected_output([3] * 12, 12)


def test_samples_of_a_request_share_its_priority_and_arrival() -> None:
    harness = Harness(max_num_seqs=4, policy="priority")  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=3, n=3, ignore_eos=True)
    parent = Sequence(harness.scheduler.new_seq_id(), "n3", [5] * 4, params, 7, priority=2)
    harness.scheduler.add(parent)
    later = harness.add([6] * 4, 3, priority=2)
    out = harness.scheduler.schedule()
    harness.scheduler.update(out, fake_run(out))
    running = harness.scheduler.running
    assert [s.request_id for s in running] == ["n3"] * 3 + [later.request_id]
    assert {(s.priority, s.arrival) for s in running[:3]} == {(2, parent.arrival)}


def test_a_bad_policy_and_a_priority_under_fcfs_are_refused(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="scheduling policy must be one of fcfs, priority"):
        SchedulerConfig(policy="lifo")  # type: ignore[arg-type]
    engine = LLM(str(llama_dir), dtype="float32", device="cpu").engine
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="priority must be 0 under the scheduling policy 'fcfs'"):
        engine.add_request("a", [5, 6], params, priority=1)
    with pytest.raises(ValueError, match="priority must be an int, got bool"):
        engine.add_request("b", [5, 6], params, priority=True)
    engine.add_request("c", [5, 6], params, priority=0)  # 0 is every request's under fcfs
    assert not engine.has_request("a") and engine.has_request("c")


def _handed_off_in_order(prefill: LLMEngine, count: int) -> list[PrefillResult]:
    handed: list[PrefillResult] = []
    while len(handed) < count:
        step = prefill.step()
        assert not step.finished
        handed += step.handed_off
    return handed


def _finished_in_order(engine: LLMEngine) -> list[str]:
    order: list[str] = []
    while engine.has_unfinished_requests():
        order += [out.request_id for out in engine.step().finished]
    return order


def test_engine_runs_requests_by_priority_with_transformers_tokens(llama_dir: Path) -> None:
    llm = LLM(
        str(llama_dir), dtype="float32", device="cpu", max_num_seqs=1, scheduling_policy="priority"
    )
    prompts = [[11 + i, 40, 7 * i + 3, 9] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for i, (prompt, priority) in enumerate(zip(prompts, [3, 1, 3, 0], strict=True)):
        llm.engine.add_request(f"r{i}", prompt, params, priority=priority)
    assert _finished_in_order(llm.engine) == ["r3", "r1", "r0", "r2"]
    outputs = llm.generate(prompts, params, priority=[2, 2, 1, 0])
    assert [o.outputs[0].token_ids for o in outputs] == [
        hf_greedy(llama_dir, p, 5) for p in prompts
    ]
    with pytest.raises(ValueError, match="priority has 1 entries for 4 prompts"):
        llm.generate(prompts, params, priority=[1])


def test_a_prefilled_request_keeps_its_priority_on_the_decode_side(llama_dir: Path) -> None:
    def engine(policy: str) -> LLMEngine:
        return LLM(
            str(llama_dir), dtype="float32", device="cpu", max_num_seqs=1, scheduling_policy=policy
        ).engine  # type: ignore[arg-type]

    prefill, decode = engine("priority"), engine("priority")
    prompts = [[20 + i, 5, 6, 7 + i] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, priority in enumerate([4, 2, 8]):
        prefill.add_request(f"r{i}", prompts[i], params, prefill_only=True, priority=priority)
    handed = _handed_off_in_order(prefill, 3)
    assert [r.request_id for r in handed] == ["r1", "r0", "r2"]
    assert {r.request_id: r.priority for r in handed} == {"r0": 4, "r1": 2, "r2": 8}
    # admitted in arrival order, decoded by priority
    for result in sorted(handed, key=lambda r: r.request_id):
        dst = decode.reserve_blocks(result.request_id, result.num_prompt_tokens)
        assert dst is not None
        decode.kv_cache[:, :, dst] = prefill.kv_cache[:, :, result.block_ids]
        decode.admit_prefilled(result, kv_received=True)
        prefill.release_lease(result.request_id)
    assert _finished_in_order(decode) == ["r1", "r0", "r2"]
    # a decode engine under fcfs refuses a result with a priority
    fcfs = engine("fcfs")
    prefill.add_request("r9", prompts[0], params, prefill_only=True, priority=1)
    (result,) = _handed_off_in_order(prefill, 1)
    with pytest.raises(ValueError, match="priority must be 0 under the scheduling policy"):
        fcfs.admit_prefilled(result, kv_received=False)
