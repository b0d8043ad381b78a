"""``python -m bench.expert_parallel`` runs end to end at tiny sizes: both layouts of two ranks
on the same batch, each holding half of the experts' bytes, the share of pairs rank 0's experts
took, and greedy outputs compared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--model", "tiny", "--num-prompts", "3", "--min-prompt-len", "8", "--max-prompt-len", "24",
    "--output-len", "6", "--prefill-tokens", "20", "--decode-batch", "3",
    "--decode-context", "12", "--num-steps", "3", "--rounds", "1",
]  # fmt: skip


def test_the_benchmark_runs_both_layouts_and_compares_their_tokens(tmp_path: Path) -> None:
    out = tmp_path / "ep.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.expert_parallel", *TINY, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    columns, whole = result["runs"]
    assert (columns["expert_parallel"], whole["expert_parallel"]) == (False, True)
    # 8 experts of 32 columns over hidden 64, 2 layers: half of 2 x 8 x 3 x 32 x 64 floats
    assert columns["rank0_expert_bytes"] == whole["rank0_expert_bytes"] == 8 * 3 * 32 * 64 * 4
    for layout in (columns, whole):
        assert 0 < layout["rank0_pair_share_in_batch"] < 1
        assert layout["throughput"]["output_tokens_per_second"] > 0
        # the same collectives either way: the MoE block's one all-reduce per layer
        calls = layout["decode_step"]["collectives"]["calls_per_step"]
        assert calls["all_reduce"] == 2 * 2 + 1
    assert result["greedy"]["passed"]
    assert set(result["summary"]["ep_over_columns"]) >= {"decode_step_ms", "prefill_step_ms"}
    assert "experts whole / by columns" in run.stdout
