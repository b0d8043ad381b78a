"""``python -m bench.mtp`` runs end to end at a tiny size: every engine's output is the
baseline's, the exact prediction layer's drafts all stand and the perturbed one's not all."""

from __future__ import annotations

import json
from pathlib import Path

from bench.mtp import main


def test_the_benchmark_compares_each_prediction_layer_with_none(tmp_path: Path) -> None:
    out = tmp_path / "mtp.json"
    argv = ["--num-layers", "2", "--hidden-size", "64", "--batch-sizes", "2"]
    report = main([*argv, "--output-len", "24", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text())["results"] == report["results"]
    rows = {row["drafts"]: row for row in report["results"]}
    assert set(rows) == {"none", "exact", "perturbed"}
    for row in rows.values():
        assert row["num_outputs_differing_from_baseline"] == 0
        assert row["output_tokens_per_s"] > 0
    assert rows["exact"]["acceptance_rate"] == 1.0
    assert 0.0 < rows["perturbed"]["acceptance_rate"] < 1.0
    assert rows["exact"]["num_steps"] < rows["none"]["num_steps"]
