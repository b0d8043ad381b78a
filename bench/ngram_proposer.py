"""The ngram proposer's host time per sequence and step: its packed context kept between steps
against packing the whole context afresh (the baseline), in the same run.

    .venv/bin/python -m bench.ngram_proposer [--contexts 256,1024,4096,16384] [--steps 300]

Each case grows one sequence of random token ids (a 32k vocabulary) by one token per step from
the context length, asking for 4 drafts with n-grams of 1 to 5 each step, the way the
scheduler asks for a decoding sequence; both ways see the same tokens and must propose the
same drafts. Prints a table and writes JSON (microseconds per call, medians of 5 runs).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from bench.results_json import write_json
from engine.speculative.config import SpeculativeConfig
from engine.speculative.ngram import NgramProposer

VOCAB_SIZE = 32000
CONFIG = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=5, prompt_lookup_min=1)


def time_steps(context_len: int, steps: int, kept: bool, seed: int) -> tuple[float, list[Any]]:
    """Seconds per propose call over ``steps`` steps, and the proposals."""
    rng = random.Random(seed)
    token_ids = [rng.randrange(VOCAB_SIZE) for _ in range(context_len)]
    new_tokens = [rng.randrange(VOCAB_SIZE) for _ in range(steps)]
    proposer = NgramProposer(CONFIG)
    seq_id = 0 if kept else None
    proposer.propose(token_ids, 4, seq_id)  # a kept context is packed whole once, on admission
    proposals = []
    started = time.perf_counter()
    for token in new_tokens:
        token_ids.append(token)
        proposals.append(proposer.propose(token_ids, 4, seq_id))
    return (time.perf_counter() - started) / steps, proposals


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ngram_proposer")
    parser.add_argument("--contexts", default="256,1024,4096,16384")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default="bench/results/ngram_proposer.json")
    args = parser.parse_args()
    rows = []
    print(f"{'context':>8}{'afresh us':>11}{'kept us':>10}{'speed-up':>10}")
    for context_len in (int(c) for c in args.contexts.split(",")):
        seconds: dict[str, list[float]] = {"afresh": [], "kept": []}
        for run in range(args.runs):  # alternating, so drift hits both alike
            afresh, expected = time_steps(context_len, args.steps, False, run)
            kept, proposals = time_steps(context_len, args.steps, True, run)
            if proposals != expected:
                raise SystemExit(f"context {context_len}: kept contexts proposed differently")
            seconds["afresh"].append(afresh)
            seconds["kept"].append(kept)
        afresh_us = statistics.median(seconds["afresh"]) * 1e6
        kept_us = statistics.median(seconds["kept"]) * 1e6
        rows.append({"context_len": context_len, "afresh_us": afresh_us, "kept_us": kept_us})
        print(f"{context_len:>8}{afresh_us:>11.1f}{kept_us:>10.1f}{afresh_us / kept_us:>9.2f}x")
    result = {"benchmark": "ngram_proposer", "steps": args.steps, "runs": args.runs, "rows": rows}
    print(f"-> {write_json(args.out, result)}")


if __name__ == "__main__":
    main()
