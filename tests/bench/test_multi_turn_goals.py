"""The issue's goal checks on given numbers, the comparison's tables, and the driver's pure
parts: its configurations, its scales and the pdserve flags it needs."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from bench.multi_turn import (
    CONFIGS,
    build_parser,
    chosen_configs,
    missing_serve_flags,
    workload_from_args,
)
from bench.serving.multi_turn_report import (
    GoalCheck,
    Point,
    goal_checks,
    goals_text,
    goodput_goal,
    points_table,
    prefill_goal,
)


def _point(
    config: str, rate: float, computed: float | None, attainment: float, goodput: float
) -> Point:
    return Point(config, rate, 100, 100, computed, 0.5, 80.0, 400.0, attainment, goodput)


POINTS = [
    _point("kv_aware", 1, 3000, 1.00, 2.0),
    _point("kv_aware", 2, 3500, 0.97, 4.0),
    _point("kv_aware", 4, 4000, 0.92, 7.5),
    _point("prefix_affinity", 1, 5000, 1.00, 2.0),
    _point("prefix_affinity", 2, 5500, 0.95, 3.9),
    _point("prefix_affinity", 4, 6000, 0.80, 5.0),
    _point("least_loaded", 1, 9000, 0.99, 2.0),
    _point("least_loaded", 2, 9500, 0.85, 3.0),  # the first rate below 90 %
    _point("least_loaded", 4, 9900, 0.40, 1.0),
]


def test_prefill_goal_compares_the_sums_over_the_rates_both_ran() -> None:
    met = prefill_goal(POINTS, "kv_aware")  # 10500 / 16500 = 0.64 <= 0.70
    assert met.met is True and "10500 / 16500 = 0.64" in met.detail
    assert "1/s 0.60" in met.detail and "4/s 0.67" in met.detail
    worse = [
        dataclasses.replace(p, prefill_tokens_computed=5000.0) if p.config == "kv_aware" else p
        for p in POINTS
    ]
    assert prefill_goal(worse, "kv_aware").met is False  # 15000 / 16500 = 0.91
    fewer_rates = [p for p in POINTS if p.rate != 4 or p.config != "prefix_affinity"]
    assert "6500 / 10500" in prefill_goal(fewer_rates, "kv_aware").detail


def test_prefill_goal_needs_both_counters() -> None:
    unread = [dataclasses.replace(p, prefill_tokens_computed=None) for p in POINTS]
    check = prefill_goal(unread, "kv_aware")
    assert check.met is None and "no rate" in check.detail
    assert prefill_goal(POINTS, "kv_aware+host").met is None  # it did not run


def test_goodput_goal_is_checked_where_least_loaded_falls_below_ninety_percent() -> None:
    at_knee = goodput_goal(POINTS, "kv_aware")  # 2/s, least_loaded's first rate below 90 %
    assert "at 2/s (least_loaded 85% attainment)" in at_knee.detail
    assert "4.00 vs 3.00 turns/s = 1.33x" in at_knee.detail
    assert at_knee.met is False  # 1.33 < 1.5
    better = [
        dataclasses.replace(p, goodput=4.6) if (p.config, p.rate) == ("kv_aware", 2) else p
        for p in POINTS
    ]
    assert goodput_goal(better, "kv_aware").met is True  # 4.6 / 3.0 = 1.53


def test_goodput_goal_unchecked_when_least_loaded_never_falls_below() -> None:
    steady = [dataclasses.replace(p, slo_attainment=0.95) for p in POINTS]
    check = goodput_goal(steady, "kv_aware")
    assert check.met is None and "sweep higher rates" in check.detail
    only_low = [p for p in POINTS if not (p.config == "kv_aware" and p.rate == 2)]
    assert goodput_goal(only_low, "kv_aware").met is None  # ours did not run at the knee


def test_goal_checks_cover_each_configuration_that_ran() -> None:
    checks = goal_checks(POINTS, ("kv_aware", "kv_aware+host"))
    assert [c.goal.split(":")[0] for c in checks] == ["kv_aware", "kv_aware"]
    text = goals_text([*checks, GoalCheck("g", None, "why")])
    assert "[MET]" in text and "[NOT MET]" in text and "[UNCHECKED] g: why" in text
    table = points_table(POINTS)
    assert "least_loaded" in table and "85.0%" in table and "9500" in table


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_the_issue_scale_is_one_flag_away() -> None:
    small = workload_from_args(_args())
    assert (small.num_conversations, small.num_turns) == (12, 3)
    issue = workload_from_args(_args("--scale", "issue"))
    assert issue.kind == "multi-turn"
    assert (issue.num_conversations, issue.num_turns, issue.system_prompt_len) == (64, 6, 1000)
    assert issue.user_range == (50, 200) and issue.reply_range == (100, 200)
    custom = workload_from_args(_args("--num-turns", "2", "--reply-range", "10,20"))
    assert custom.num_turns == 2 and custom.reply_range == (10, 20)


def test_configurations_are_checked() -> None:
    assert chosen_configs("kv_aware, least_loaded") == ["kv_aware", "least_loaded"]
    assert chosen_configs(",".join(CONFIGS)) == list(CONFIGS)
    with pytest.raises(ValueError, match="round_robin"):
        chosen_configs("round_robin")


HELP = """usage: pdserve serve [-h] [--router-policy {round_robin,least_loaded,prefix_affinity}]
  --num-kv-blocks NUM_KV_BLOCKS
"""


def test_missing_serve_flags_are_named() -> None:
    assert missing_serve_flags(["prefix_affinity", "least_loaded", "vllm"], HELP) == []
    assert missing_serve_flags(list(CONFIGS), HELP) == [
        "--router-policy kv_aware",
        "--kv-offload-gb",
    ]
    newer = HELP.replace("prefix_affinity}", "prefix_affinity,kv_aware}") + "  --kv-offload-gb G\n"
    assert missing_serve_flags(list(CONFIGS), newer) == []
