"""``python -m bench.beam_search`` runs end to end at a tiny size: both sides search the same
prompts, every beam runs its max_tokens, and the JSON holds both timings and the agreement."""

from __future__ import annotations

import json
from pathlib import Path

from bench.beam_search import main


def test_the_benchmark_times_both_searches_and_compares_their_beams(tmp_path: Path) -> None:
    out = tmp_path / "beams.json"
    argv = ["--num-prompts", "2", "--beam-width", "2", "--max-tokens", "4", "--hf-batch", "2"]
    result = main([*argv, "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["workload"]["beam_width"] == 2
    for side in ("pdserve", "transformers"):
        assert result[side]["seconds"] > 0 and result[side]["beam_tokens_per_second"] > 0
    assert result["speedup"] > 0
    assert result["prompts_with_equal_beams"] == 2  # (two short searches, no near-tie)
