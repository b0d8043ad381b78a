"""``python -m bench.draft_model`` runs end to end at a tiny size: the deepened demo target
writes the demo model's text, every engine's output is the baseline's, and the exact draft's
drafts all stand."""

from __future__ import annotations

import json
from pathlib import Path

from bench.draft_model import deepened_demo, main
from bench.speculative import DEMO_MODEL
from engine import LLM, SamplingParams


def test_the_deepened_target_writes_the_demo_models_text(tmp_path: Path) -> None:
    target = deepened_demo(tmp_path / "target", 8)
    assert json.loads((target / "config.json").read_text())["num_hidden_layers"] == 8
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [100, 200, 300]]
    outputs = [
        [o.outputs[0].token_ids for o in LLM(str(m), device="cpu").generate(prompts, params)]
        for m in (DEMO_MODEL, target)
    ]
    assert outputs[0] == outputs[1]


def test_the_benchmark_compares_each_draft_with_none(tmp_path: Path) -> None:
    out = tmp_path / "draft_model.json"
    argv = ["--batch-sizes", "2", "--output-len", "12", "--repeats", "1", "--deepen-to", "8"]
    report = main([*argv, "--out", str(out)])
    assert json.loads(out.read_text())["results"] == report["results"]
    rows = {row["drafts"]: row for row in report["results"]}
    assert set(rows) == {"none", "ngram", "exact", "noisy"}
    for row in rows.values():
        assert row["num_outputs_differing_from_baseline"] == 0
        assert row["output_tokens_per_s"] > 0
    assert rows["exact"]["acceptance_rate"] == 1.0
    assert rows["none"]["num_draft_tokens"] == 0
