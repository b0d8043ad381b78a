"""A prompt's predicted TTFT and TPOT from the workers' loads and their fitted step times."""

from __future__ import annotations

import pytest

from engine.messages import StepTiming, TransferTiming, WorkerLoad
from router.latency_forecast import Forecast, LatencyForecaster, PromptToPlace, StepBudgets
from router.latency_model import LatencyModel


def _approx(expected: float) -> object:
    """Up to the fit's ridge (a relative 1e-6)."""
    return pytest.approx(expected, rel=1e-4)


# steps cost 2 ms + 100 us a prompt token (no attention cost) + 1 ms a decode row
OVERHEAD, PER_TOKEN, PER_ROW = 2e-3, 100e-6, 1e-3


def _model() -> LatencyModel:
    model = LatencyModel()
    prompts = [StepTiming(n, 0, 0, 0, OVERHEAD + PER_TOKEN * n) for n in (16, 64, 128, 256)] * 4
    decodes = [StepTiming(0, 0, r, 0, OVERHEAD + PER_ROW * r) for r in (1, 2, 4, 8)] * 4
    model.observe("p0", "prefill", prompts)
    model.observe("d0", "decode", decodes)
    model.observe(
        "p0",
        "prefill",
        [],
        [TransferTiming(b, b * 1000, 1e-3 + b * 1e-5, "shm") for b in (1, 8, 32)],
    )
    return model


def _load(worker_id: str, queued: int = 0, waiting: int = 0, running: int = 0) -> WorkerLoad:
    return WorkerLoad(worker_id, waiting, running, queued, 0.0)


def _forecaster(
    model: LatencyModel, *, colocated: bool = False, by_priority: bool = False
) -> LatencyForecaster:
    return LatencyForecaster(
        model,
        StepBudgets(prefill=256, decode=256),
        16,
        colocated=colocated,
        by_priority=by_priority,
    )


def _mixed_steps() -> list[StepTiming]:
    """A colocated worker's steps: prompt chunks with decode rows, at the true costs."""
    return [
        StepTiming(p, 0, r, 0, OVERHEAD + PER_TOKEN * p + PER_ROW * r)
        for p in (0, 32, 128)
        for r in (1, 8, 32)
    ] * 2


def _two_by_two(forecaster: LatencyForecaster) -> Forecast:
    """The forecast of a 200-token prompt over p0 (2000 tokens queued), p1 (50), d0 (8
    running) and d1 (1)."""
    prefill = [_load("p0", queued=2000, waiting=8), _load("p1", queued=50, waiting=1)]
    decode = [_load("d0", running=8), _load("d1", running=1)]
    forecast = forecaster.forecast(PromptToPlace(200, 10), prefill, decode, {})
    assert forecast is not None
    return forecast


def test_an_idle_cluster_predicts_the_prompts_own_steps_and_a_batch_of_one() -> None:
    forecaster = _forecaster(_model())
    forecast = forecaster.forecast(PromptToPlace(100, 10), [_load("p0")], [_load("d0")], {})
    assert forecast is not None
    assert forecast.queue_s == 0
    assert forecast.ttft_s == _approx(OVERHEAD + PER_TOKEN * 100)
    assert forecast.tpot_s == _approx(OVERHEAD + PER_ROW * 1)
    assert forecast.handoff_s == _approx(1e-3 + 7 * 1e-5)  # 7 blocks of 16 tokens


def test_queued_prompt_tokens_wait_in_steps_of_the_budget() -> None:
    """600 tokens queued ahead, 100 of its own, at 256 a step: 3 steps."""
    forecaster = _forecaster(_model())
    forecast = forecaster.forecast(
        PromptToPlace(100, 10), [_load("p0", queued=600, waiting=3)], [_load("d0")], {}
    )
    assert forecast is not None
    assert forecast.queue_s == _approx(3 * OVERHEAD + PER_TOKEN * 600)
    assert forecast.ttft_s == _approx(3 * OVERHEAD + PER_TOKEN * 700)


def test_the_best_placement_is_the_least_queued_and_a_cached_prefix_is_not_recomputed() -> None:
    forecaster = _forecaster(_model())
    prefill = [_load("p0", queued=2000, waiting=8), _load("p1", queued=50, waiting=1)]
    decode = [_load("d0", running=8), _load("d1", running=1)]
    forecast = forecaster.forecast(PromptToPlace(200, 10), prefill, decode, {})
    assert forecast is not None
    assert (forecast.prefill_worker_id, forecast.decode_worker_id) == ("p1", "d1")
    assert forecast.tpot_s == _approx(OVERHEAD + 2 * PER_ROW)
    cached = forecaster.forecast(
        PromptToPlace(200, 10, cached_tokens={"p1": 160}), prefill, decode, {}
    )
    assert cached is not None
    assert cached.ttft_s == _approx(OVERHEAD + PER_TOKEN * (50 + 40))


def test_every_candidate_is_predicted_and_those_within_limits_are_the_allowed_placements() -> None:
    forecast = _two_by_two(_forecaster(_model()))
    assert forecast.ttft_on("p1") == _approx(forecast.ttft_s)
    # p0: 2000 queued + 200 of its own at 256 a step: 9 steps
    assert forecast.ttft_on("p0") == _approx(9 * OVERHEAD + PER_TOKEN * 2200)
    assert forecast.tpot_on("d0") == _approx(OVERHEAD + 9 * PER_ROW)
    assert forecast.tpot_on("d1") == _approx(OVERHEAD + 2 * PER_ROW)
    wide = forecast.workers_within(1.0, 1.0)
    assert wide is not None
    assert (wide.prompt_worker_ids, wide.decode_worker_ids) == ({"p0", "p1"}, {"d0", "d1"})
    tight = forecast.workers_within(0.05, 0.005)
    assert tight is not None
    assert (tight.prompt_worker_ids, tight.decode_worker_ids) == ({"p1"}, {"d1"})
    assert forecast.workers_within(0.01, 1.0) is None  # no prompt worker makes 10 ms
    assert forecast.workers_within(1.0, 0.002) is None  # nor a decode worker 2 ms


def test_a_colocated_placement_is_one_worker_making_both_latencies() -> None:
    """c0 has the shorter queue but the larger batch, c1 the reverse: the best TTFT is c0's, so
    the forecast's TPOT is c0's too, not c1's; a limit on both allows the worker that makes
    both, and none when neither does."""
    model = LatencyModel()
    mixed = _mixed_steps()
    model.observe("c0", "decode", mixed)
    model.observe("c1", "decode", mixed)
    forecaster = _forecaster(model, colocated=True)
    loads = [_load("c0", running=40), _load("c1", queued=1000, waiting=4, running=2)]
    forecast = forecaster.forecast(PromptToPlace(100, 50), [], loads, {})
    assert forecast is not None
    assert forecast.prefill_worker_id == forecast.decode_worker_id == "c0"
    assert forecast.tpot_s == _approx(OVERHEAD + PER_ROW * 41)
    c0_ttft, c1_tpot = forecast.ttft_on("c0"), forecast.tpot_on("c1")
    assert c1_tpot < forecast.tpot_s and forecast.ttft_on("c1") > c0_ttft
    assert forecast.workers_within(c0_ttft, c1_tpot) is None  # c0 is too slow a step, c1 late
    assert forecast.least_tpot_within(c0_ttft) == _approx(forecast.tpot_s)
    allowed = forecast.workers_within(c0_ttft, forecast.tpot_s)
    assert allowed is not None
    assert allowed.prompt_worker_ids == allowed.decode_worker_ids == {"c0"}


def test_the_paths_median_corrects_every_candidate_and_its_tail_is_what_admission_adds() -> None:
    """Requests finished 10 ms after their steps' TTFT, a tenth of them 110 ms after, and
    TPOT 1 ms after: each candidate gets the median, 10 ms; the tail is the residuals' 0.9
    quantile asked for (of 20, 0.9: interpolated, 10 % of the way from 10 to 110 ms) less the
    median."""
    model = _model()
    for i in range(20):
        model.observe_request(0.110 if i % 10 == 9 else 0.010, 0.001)
    forecast = _two_by_two(_forecaster(model))
    assert forecast.ttft_on("p0") == _approx(9 * OVERHEAD + PER_TOKEN * 2200 + 0.010)
    assert forecast.steps_ttft_s == _approx(OVERHEAD + PER_TOKEN * 250)  # p1's: 27 ms
    assert forecast.ttft_s == _approx(0.037)
    assert forecast.tails(0.9) == pytest.approx((0.010, 0.0), abs=1e-9)
    assert forecast.tails(None) == (0.0, 0.0)
    assert forecast.workers_within(0.040, 1.0) is not None
    assert forecast.workers_within(0.040, 1.0, tail_quantile=0.9) is None  # 47 ms with its tail
    assert forecast.workers_within(0.0475, 1.0, tail_quantile=0.9) is not None
    # the 0.95 quantile's tail: 100 ms (both slow ones), so 137 ms in all
    assert forecast.workers_within(0.0475, 1.0, tail_quantile=0.95) is None
    assert forecast.workers_within(0.1375, 1.0, tail_quantile=0.95) is not None


def test_the_first_gaps_excess_is_spread_over_the_requests_gaps() -> None:
    """Its first gap 50 ms longer than the rest, on median: 5 ms more a token over 11
    tokens, 1 ms over 51."""
    model = _model()
    for _ in range(3):
        model.observe_request(0.0, 0.0, 0.050)
    forecaster = _forecaster(model)
    short = forecaster.forecast(PromptToPlace(100, 11), [_load("p0")], [_load("d0")], {})
    long = forecaster.forecast(PromptToPlace(100, 51), [_load("p0")], [_load("d0")], {})
    assert short is not None and long is not None
    assert short.tpot_s == _approx(OVERHEAD + PER_ROW + 0.005)
    assert long.tpot_s == _approx(OVERHEAD + PER_ROW + 0.001)
    assert short.steps_tpot_s == _approx(OVERHEAD + PER_ROW)  # (the steps' own, unchanged)


def test_the_first_gaps_tail_weighs_in_the_tpot_tail_by_its_share_of_the_gaps() -> None:
    """Of 20 requests, 18 had first gaps 30 ms longer than the rest and 2 had 230 ms: at the
    0.95 quantile, a first gap 200 ms past the median. Over 11 tokens (10 gaps) that is 20 ms
    of TPOT, over 51 tokens 4 ms; the later gaps were all as predicted (no tail of their
    own)."""
    model = _model()
    for i in range(20):
        model.observe_request(0.0, 0.0, 0.230 if i % 10 == 9 else 0.030)
    forecaster = _forecaster(model)
    short = forecaster.forecast(PromptToPlace(100, 11), [_load("p0")], [_load("d0")], {})
    long = forecaster.forecast(PromptToPlace(100, 51), [_load("p0")], [_load("d0")], {})
    assert short is not None and long is not None
    assert short.tails(0.95) == pytest.approx((0.0, 0.020), abs=1e-9)
    assert long.tails(0.95) == pytest.approx((0.0, 0.004), abs=1e-9)
    assert short.tails(None) == (0.0, 0.0)


def test_a_forecast_placed_on_the_workers_the_prompt_got_predicts_theirs() -> None:
    forecast = _two_by_two(_forecaster(_model()))
    placed = forecast.placed_on("p0", "d0")
    assert (placed.prefill_worker_id, placed.decode_worker_id) == ("p0", "d0")
    assert placed.ttft_s == _approx(forecast.ttft_on("p0"))
    assert placed.steps_ttft_s == _approx(9 * OVERHEAD + PER_TOKEN * 2200)
    assert placed.tpot_s == _approx(OVERHEAD + 9 * PER_ROW)
    # a worker that was no candidate (a prompt prefilled on its decode worker): the best's
    local = forecast.placed_on("d1", "d1")
    assert local.ttft_s == forecast.ttft_s and local.prefill_worker_id == "p1"
    assert local.tpot_s == _approx(OVERHEAD + 2 * PER_ROW)


def test_under_priority_scheduling_only_the_prompts_served_first_are_ahead() -> None:
    """1000 tokens queued: 800 of priority 5, 200 of priority 0. A priority-0 request waits for
    the 200 only; a priority-5 one for all of them; in arrival order, everyone for all."""
    model = _model()
    queued = {"p0": [(5, 400), (5, 400), (0, 200)]}
    loads = [_load("p0", queued=1000, waiting=3)]
    by_priority = _forecaster(model, by_priority=True)
    urgent = by_priority.forecast(PromptToPlace(10, 4, priority=0), loads, [_load("d0")], queued)
    patient = by_priority.forecast(PromptToPlace(10, 4, priority=5), loads, [_load("d0")], queued)
    in_order = _forecaster(model).forecast(PromptToPlace(10, 4), loads, [_load("d0")], queued)
    assert urgent is not None and patient is not None and in_order is not None
    assert urgent.queue_s == _approx(OVERHEAD + PER_TOKEN * 200)
    assert patient.queue_s == _approx(in_order.queue_s)
    assert patient.queue_s == _approx(4 * OVERHEAD + PER_TOKEN * 1000)


def test_a_colocated_worker_steps_its_running_batch_with_every_prompt_chunk() -> None:
    """56 sequences decode in every step: 200 tokens of room a step, each step a decode of 56
    rows too."""
    model = LatencyModel()
    mixed = _mixed_steps()
    model.observe("d0", "decode", mixed)
    forecaster = _forecaster(model, colocated=True)
    load = _load("d0", queued=300, waiting=2, running=56)
    forecast = forecaster.forecast(PromptToPlace(100, 50), [], [load], {})
    assert forecast is not None
    step = OVERHEAD + PER_ROW * 56
    assert forecast.ttft_s == _approx(2 * step + PER_TOKEN * 400)
    assert forecast.handoff_s == 0
    # its decode: 57 rows, plus the queued prompts' chunks spread over its 50 tokens
    assert forecast.tpot_s == _approx(OVERHEAD + PER_ROW * 57 + PER_TOKEN * 300 / 50)


def test_no_forecast_before_a_role_has_a_fit() -> None:
    model = LatencyModel()
    model.observe("d0", "decode", [StepTiming(0, 0, 1, 0, 0.003)] * 10)
    forecaster = _forecaster(model)
    assert forecaster.forecast(PromptToPlace(10, 4), [_load("p0")], [_load("d0")], {}) is None
    assert forecaster.forecast(PromptToPlace(10, 4), [], [_load("d0")], {}) is None  # no worker


def test_a_decode_worker_whose_hand_offs_wait_for_blocks_adds_the_wait_to_tpot() -> None:
    """A full decode worker's wait delays each request's second token: spread over its tokens
    after the first, it counts in TPOT, and the forecast prefers a worker with room."""
    model = _model()
    waited = TransferTiming(8, 8000, 1e-3 + 8e-5, "shm", "d0", 0.9)
    model.observe("p0", "prefill", [], [waited] * 3)
    forecaster = _forecaster(model)
    prompt = PromptToPlace(100, 10)
    alone = forecaster.forecast(prompt, [_load("p0")], [_load("d0")], {})
    assert alone is not None and alone.decode_worker_id == "d0"
    assert alone.tpot_s == _approx(OVERHEAD + PER_ROW + 0.9 / 9)
    assert alone.handoff_s == pytest.approx(0.9 + 1e-3 + 7e-5, rel=1e-3)
    # a decode worker with room (and a busier batch) is the better placement
    both = forecaster.forecast(prompt, [_load("p0")], [_load("d0"), _load("d1", running=3)], {})
    assert both is not None and both.decode_worker_id == "d1"
    assert both.tpot_s == _approx(OVERHEAD + PER_ROW * 4)
    assert both.handoff_s == pytest.approx(1e-3 + 7e-5, rel=1e-3)
    # colocated workers hand nothing off
    colocated = _forecaster(model, colocated=True).forecast(prompt, [], [_load("d0")], {})
    assert colocated is not None and colocated.handoff_s == 0.0
