"""``python -m bench.tensor_parallel`` runs end to end at tiny sizes: TP 1 and TP 2 on the same
batch, rank 0's collectives counted per step, greedy outputs compared; and the near-tie probe
that a divergence would call reads the top-2 logits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.tensor_parallel import (
    COLLECTIVES,
    SPECS,
    WHAT_TWO_CORES_SHOW,
    first_divergence,
    parse_args,
    top2_gaps,
)
from engine import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--model", "tiny", "--num-prompts", "3", "--min-prompt-len", "8", "--max-prompt-len", "24",
    "--output-len", "6", "--prefill-tokens", "20", "--decode-batch", "3",
    "--decode-context", "12", "--num-steps", "3",
]  # fmt: skip


def test_the_benchmark_runs_both_sizes_and_counts_rank_zeros_collectives(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.tensor_parallel", *TINY, "--rounds", "1", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert WHAT_TWO_CORES_SHOW in run.stdout
    result = json.loads(out.read_text())
    runs = result["runs"]
    tp1, tp2 = runs[:2]  # the baseline first, on all cores' threads
    assert (tp1["tensor_parallel_size"], tp2["tensor_parallel_size"]) == (1, 2)
    assert tp2["threads_per_rank"] == max(1, tp1["threads_per_rank"] // 2)  # the cores, shared
    if tp1["threads_per_rank"] > 1:  # and one thread's TP 1, the reference for one core
        assert [r["config"] for r in runs[2:]] == ["TP 1 x 1 thread"]
    for r in runs:
        assert r["throughput"]["output_tokens_per_second"] > 0
        assert 0 <= r["other_processes_cpu_share"] <= 1
        assert r["prefill_step"]["num_tokens"] == 20 and len(r["prefill_step"]["step_ms"]) == 3
        assert r["decode_step"]["num_tokens"] == 3 and len(r["decode_step"]["step_ms"]) == 3
    assert tp1["throughput"]["collectives"] is None and tp1["decode_step"]["collectives"] is None
    spec = SPECS["tiny"]
    all_reduces = 2 * spec.num_layers + 1  # attention and MLP of each layer, the embedding
    for step, num_tokens, num_logits in (("prefill_step", 20, 1), ("decode_step", 3, 3)):
        collectives = tp2[step]["collectives"]
        assert collectives["calls_per_step"]["all_reduce"] == all_reduces
        assert collectives["calls_per_step"]["all_gather"] == 1  # the logits, once per step
        assert collectives["calls_per_step"]["broadcast"] >= 2  # a forward's command and ids
        by_kind = collectives["bytes_by_kind"]
        assert by_kind["all_reduce"] == all_reduces * num_tokens * spec.hidden_size * 4
        assert by_kind["all_gather"] == num_logits * (spec.vocab_size // 2) * 4
        assert 0 < collectives["median_ms"] < tp2[step]["median_ms"]
        assert set(collectives["median_ms_by_kind"]) == set(COLLECTIVES)
    assert 0 < tp2["throughput"]["collective_share"] < 1
    assert result["greedy"]["passed"]
    num_equal = result["greedy"]["num_equal"][f"round 0, {tp2['config']}"]
    assert num_equal + len(result["greedy"]["divergences"]) == 3
    assert set(result["summary"]["tp2_over"]) == {r["config"] for r in runs} - {tp2["config"]}


def test_top2_gaps_reads_the_greedy_token_first(tmp_path: Path) -> None:
    args = parse_args(TINY)
    model_dir = SPECS["tiny"].write_config(tmp_path, 8192, "float32")
    contexts = [[5, 9, 33, 70, 2 * i + 11] for i in range(3)]
    gaps = top2_gaps(model_dir, args, contexts)
    llm = LLM(str(model_dir), load_format="dummy", dtype="float32", skip_tokenizer_init=True)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1)
        greedy = [o.outputs[0].token_ids[0] for o in llm.generate(contexts, params)]
    finally:
        llm.close()
    assert len(gaps) == len(contexts)
    for (gap, top2), token in zip(gaps, greedy):
        assert gap >= 0 and len(set(top2)) == 2
        assert top2[0] == token


def test_first_divergence_is_the_first_differing_position() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 4, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
