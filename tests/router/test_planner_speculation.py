"""``pdserve plan --num-speculative-tokens K --draft-acceptance R``: the simulated workers'
scheduler asks for K drafts a decoding sequence a step, they cost what the step computes, and
they stand as often as R says."""

from __future__ import annotations

import argparse

import pytest

from router.latency_model import StepShape
from router.planner.command import serve_flags, speculation
from router.planner.plan import Layout
from router.planner.simulator import ClusterShape, Simulation, WorkerShape, WorkloadRequest
from router.planner.speculation import DraftChecks, PlannedDrafts, Speculation


def _linear(seconds_per_step: float, per_token: float) -> WorkerShape:
    def step(shape: StepShape) -> float:
        return seconds_per_step + per_token * (shape.num_prefill_tokens + shape.num_decode_tokens)

    return WorkerShape(1, step, num_kv_blocks=1000, max_num_batched_tokens=256)


def test_the_acceptance_pdserve_reports_is_the_share_of_drafts_that_stand() -> None:
    """Of K drafts each standing after the one before with probability a, (a + ... + a^K) / K
    stand on average: one draft stands at the acceptance itself; the draws agree."""
    assert Speculation(1, 0.6).stands_after_previous == pytest.approx(0.6)
    three = Speculation(3, 0.5)
    a = three.stands_after_previous
    assert (a + a**2 + a**3) / 3 == pytest.approx(0.5)
    checks = DraftChecks(three, seed=1)
    standing = [checks.num_standing(3) for _ in range(20_000)]
    assert sum(standing) / len(standing) / 3 == pytest.approx(0.5, abs=0.01)
    assert max(standing) == 3 and min(standing) == 0
    assert DraftChecks(Speculation(4, 1.0)).num_standing(4) == 4
    assert DraftChecks(Speculation(4, 0.0)).num_standing(4) == 0
    with pytest.raises(ValueError, match=r"--num-speculative-tokens must be in \[1, 16\]"):
        Speculation(0, 0.5)
    with pytest.raises(ValueError, match=r"--draft-acceptance must be in \[0, 1\], got 1.5"):
        Speculation(3, 1.5)


def _decode(
    acceptance: float | None, output_len: int = 13, draft_rate: float = 1.0
) -> tuple[float, float]:
    """(TTFT, TPOT) of one request of 100 prompt tokens on a colocated worker whose step takes
    10 ms + 1 ms a token computed, speculating 3 drafts at ``acceptance`` (None: not)."""
    spec = None if acceptance is None else Speculation(3, acceptance, draft_rate=draft_rate)
    cluster = ClusterShape(_linear(0.010, 1e-3), speculation=spec)
    (run,) = Simulation(cluster, [WorkloadRequest(0.0, tuple(range(100)), output_len)]).run()
    assert run.num_tokens == output_len and run.ttft_s is not None and run.tpot_s is not None
    return run.ttft_s, run.tpot_s


def test_drafts_that_stand_cut_the_steps_and_drafts_that_fall_cost_their_compute() -> None:
    """Without drafts: 12 decode steps of 11 ms for 12 tokens after the first. All standing:
    each step computes its token and 3 drafts (14 ms) and takes 4 tokens, 3 steps for 12.
    None standing: 12 steps of up to 14 ms, one token each."""
    ttft, plain = _decode(None)
    assert ttft == pytest.approx(0.010 + 0.100)  # the prompt's step: drafts do not touch it
    assert plain == pytest.approx(0.011)
    assert _decode(1.0)[1] == pytest.approx(3 * 0.014 / 12)
    # (the last three steps have room for 2, 1 and no drafts before the request's end)
    assert _decode(0.0)[1] == pytest.approx((9 * 0.014 + 0.013 + 0.012 + 0.011) / 12)
    # in between, fewer steps than tokens
    assert _decode(1.0)[1] < _decode(0.7)[1] < plain < _decode(0.0)[1]
    # near max_tokens a sequence drafts no further than its end: 5 tokens after the first are
    # 4 + 1 (the second step drafts none: one token left)
    assert _decode(1.0, output_len=6)[1] == pytest.approx((0.014 + 0.011) / 5)


def test_the_roofline_is_told_a_speculating_sequence_reads_its_kv_once() -> None:
    """The shapes a simulated worker's steps are timed by: a decode step of one sequence at
    position 100 with its token and 3 drafts is 4 rows attending to the context (as reported:
    4 x 101) but reads 104 positions' KV once (``decode_kv_tokens``); without speculation the
    reported counts stand."""
    shapes: list[StepShape] = []

    def step(shape: StepShape) -> float:
        shapes.append(shape)
        return 0.010

    worker = WorkerShape(1, step, num_kv_blocks=1000, max_num_batched_tokens=256)
    cluster = ClusterShape(worker, speculation=Speculation(3, 0.0))
    Simulation(cluster, [WorkloadRequest(0.0, tuple(range(100)), 5)]).run()
    decode = shapes[1]  # after the prompt's step
    assert (decode.num_decode_tokens, decode.decode_context_tokens) == (4, 4 * 101)
    assert decode.decode_kv_tokens == 104
    assert decode.attention_pairs == 101 + 102 + 103 + 104
    shapes.clear()
    Simulation(ClusterShape(worker), [WorkloadRequest(0.0, tuple(range(100)), 5)]).run()
    assert shapes[1].decode_kv_tokens is None and shapes[1].attention_pairs is None


def test_a_step_without_drafts_found_computes_its_token_alone() -> None:
    """``--draft-rate 0``: the proposer never finds drafts, so every step is the plain one
    (11 ms), not one of drafts that fell (14 ms). In between, each time a sequence asks it
    gets drafts at that rate: with every draft standing, a step with drafts takes 4 tokens in
    14 ms and one without 1 in 11 ms."""
    plain = _decode(None)[1]
    assert _decode(0.0, draft_rate=0.0)[1] == pytest.approx(plain)
    assert _decode(1.0, draft_rate=0.0)[1] == pytest.approx(plain)
    # many tokens: the mean step time per token at rate 0.5, (0.5*14 + 0.5*11) / (0.5*4 + 0.5)
    long = _decode(1.0, output_len=4001, draft_rate=0.5)[1]
    assert long == pytest.approx((0.5 * 0.014 + 0.5 * 0.011) / 2.5, rel=0.03)
    assert _decode(1.0)[1] < long < plain
    proposer = PlannedDrafts(Speculation(3, 1.0, draft_rate=0.25), token=7, seed="decode-0")
    found = [proposer.propose((1, 2), 3) for _ in range(4000)]
    assert {f for f in found} == {(), (7, 7, 7)}
    assert found.count(()) / len(found) == pytest.approx(0.75, abs=0.03)
    with pytest.raises(ValueError, match=r"--draft-rate must be in \[0, 1\], got -0.1"):
        Speculation(3, 0.5, draft_rate=-0.1)


def test_no_drafts_while_more_sequences_run_than_the_batch_size_allows() -> None:
    """A worker that drafts only while one sequence runs (as the engine judges it, when a step
    is scheduled), every draft standing, two prompts of 100 tokens and 13 out. A is prefilled
    alone (110 ms); the next step decodes A with 3 drafts beside B's prompt (114 ms: A at 5
    tokens); then both run, no drafts, 8 steps of two rows (12 ms each: A done); B alone
    drafts again: 4 more tokens in one step (14 ms)."""
    spec = Speculation(3, 1.0, disable_by_batch_size=1)
    cluster = ClusterShape(_linear(0.010, 1e-3), speculation=spec)
    prompts = [WorkloadRequest(0.0, tuple(range(i, i + 100)), 13) for i in (0, 500)]
    first, second = Simulation(cluster, prompts).run()
    assert first.tpot_s == pytest.approx((0.114 + 8 * 0.012) / 12)
    assert second.tpot_s == pytest.approx((8 * 0.012 + 0.014) / 12)
    with pytest.raises(ValueError, match="--speculative-disable-by-batch-size must be >= 1"):
        Speculation(3, 0.5, disable_by_batch_size=0)


def test_the_plans_serve_flags_carry_the_speculation_it_simulated() -> None:
    args = argparse.Namespace(
        router_policy="kv_aware", kv_cache_dtype="auto", max_local_prefill_length=0,
        max_prefill_queue_tokens=None, num_speculative_tokens=4, draft_acceptance=0.6,
        kv_offload_gb=8.0, speculative_disable_by_batch_size=None, draft_rate=1.0,
    )  # fmt: skip
    flags = serve_flags(Layout(0, 1, 2, 1), args)
    assert flags[-4:] == [
        "--kv-offload-gb",
        "8",
        "--speculative-config",
        """'{"method": "ngram", "num_speculative_tokens": 4}'""",
    ]
    assert speculation(args) == Speculation(4, 0.6)
    args.speculative_disable_by_batch_size = 8
    assert serve_flags(Layout(0, 1, 2, 1), args)[-1] == (
        """'{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 8}'"""
    )
    assert speculation(args) == Speculation(4, 0.6, disable_by_batch_size=8)
    args.draft_rate = 0.3  # the planner's, not serve's: the serve line is the same
    assert serve_flags(Layout(0, 1, 2, 1), args)[-1].endswith('"disable_by_batch_size": 8}\'')
    assert speculation(args) == Speculation(4, 0.6, disable_by_batch_size=8, draft_rate=0.3)
    assert speculation(argparse.Namespace(num_speculative_tokens=None)) is None
