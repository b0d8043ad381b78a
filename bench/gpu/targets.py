"""bench.gpu's targets: the goals, and each one's pass/fail from a result dict (no torch)."""

from __future__ import annotations

from typing import Any

MAX_DECODE_B1_TO_ROOFLINE = 1.15  # batch-1 decode step within this factor of its roofline
MIN_SPEEDUP_VS_TRANSFORMERS = 3.0  # batch decode throughput against transformers generate
MIN_PREFILL_FRACTION_OF_PEAK = 0.60  # at PREFILL_TARGET_TOKENS
PREFILL_TARGET_TOKENS = 8192
MIN_TRANSFER_FRACTION_OF_COPY = 0.80  # KV transfer against a same-size device copy


def verdict(
    target: str, model: str, value: float | None, goal: str, passed: bool | None, note: str = ""
) -> dict[str, Any]:
    """One target's outcome; ``passed`` None when the run did not measure what it needs."""
    return {
        "target": target,
        "model": model,
        "value": value,
        "goal": goal,
        "passed": passed,
        "note": note,
    }


def verdicts(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target's verdict from a bench.gpu result dict."""
    out = []
    for name, model in result["models"].items():
        if "pdserve" not in model:
            failed = "pdserve" in model.get("errors", {})
            note = "failed: see errors" if failed else "not run yet"
            out.append(verdict("pdserve measured", name, None, "-", None, note))
            continue
        out += _decode_verdicts(name, model["pdserve"])
        out += _speedup_verdicts(name, model)
        out += _prefill_verdicts(name, model["pdserve"])
    if "kv_transfer" in result:
        out += _transfer_verdicts(result["kv_transfer"])
    return out


def _decode_verdicts(name: str, pdserve: dict[str, Any]) -> list[dict[str, Any]]:
    goal = f"<= {MAX_DECODE_B1_TO_ROOFLINE}x"
    rows = [r for r in pdserve["decode"] if r["batch_size"] == 1]
    if not rows:
        return [verdict("batch-1 decode / roofline", name, None, goal, None, "batch 1 not run")]
    ratio = rows[0]["ratio_to_roofline"]
    return [
        verdict("batch-1 decode / roofline", name, ratio, goal, ratio <= MAX_DECODE_B1_TO_ROOFLINE)
    ]


def _speedup_verdicts(name: str, model: dict[str, Any]) -> list[dict[str, Any]]:
    hf = model.get("transformers")
    if hf is None:
        failed = "transformers" in model.get("errors", {})
        note = "transformers failed: see errors"
        return (
            [verdict("decode tok/s / transformers", name, None, "-", None, note)] if failed else []
        )
    batch_size = hf["generate"]["batch_size"]
    target = f"batch-{batch_size} decode tok/s / transformers generate"
    goal = f">= {MIN_SPEEDUP_VS_TRANSFORMERS}x"
    rows = [r for r in model["pdserve"]["decode"] if r["batch_size"] == batch_size]
    if not rows:
        return [verdict(target, name, None, goal, None, f"pdserve batch {batch_size} not run")]
    speedup = rows[0]["tokens_per_s"] / hf["generate"]["decode_tokens_per_s"]
    return [verdict(target, name, speedup, goal, speedup >= MIN_SPEEDUP_VS_TRANSFORMERS)]


def _prefill_verdicts(name: str, pdserve: dict[str, Any]) -> list[dict[str, Any]]:
    rows = sorted(pdserve["prefill"], key=lambda r: r["tokens"])
    at_target = [r for r in rows if r["tokens"] == PREFILL_TARGET_TOKENS]
    row = at_target[0] if at_target else rows[-1]
    note = "" if at_target else f"target is at {PREFILL_TARGET_TOKENS} tokens; not run"
    fraction = row["fraction_of_peak"]
    return [
        verdict(
            f"prefill {row['tokens']} tokens / matmul peak",
            name,
            fraction,
            f">= {MIN_PREFILL_FRACTION_OF_PEAK:.0%}",
            fraction >= MIN_PREFILL_FRACTION_OF_PEAK,
            note,
        )
    ]


def _transfer_verdicts(transfer: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        verdict(
            f"{transfer['transport']} {row['tokens']} tokens / device copy",
            "-",
            row["fraction_of_copy"],
            f">= {MIN_TRANSFER_FRACTION_OF_COPY:.0%}",
            row["fraction_of_copy"] >= MIN_TRANSFER_FRACTION_OF_COPY,
        )
        for row in transfer["rows"]
    ]
