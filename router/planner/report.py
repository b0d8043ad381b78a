"""What ``pdserve plan`` writes: the table of layouts, the goodput-vs-rate plot, the chosen
layout's ``pdserve serve`` flags and a values snippet for deploy/ (KubeRay worker groups)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from router.planner.plan import Layout, LayoutResult, Slo


def results_table(results: Sequence[LayoutResult], slo: Slo) -> str:
    """One row per layout; where kv_aware reused decode workers' caches, the share of prompts
    prefilled on their decode worker ("local") and fetched from one ("fetched"); where the
    host tiers served prefix hits, their blocks a request ("from host")."""
    rows = [
        f"{'layout':24} {'devices':>7} {'attain':>7} {'goodput/s':>9} "
        f"{'ttft p50':>9} {'ttft p90':>9} {'tpot p50':>9} {'tpot p90':>9}  meets"
    ]
    for r in results:
        notes = []
        if r.local_prefill_share or r.fetch_share:
            notes.append(f"{r.local_prefill_share:.0%} local, {r.fetch_share:.0%} fetched")
        if r.host_blocks_per_request:
            notes.append(f"{r.host_blocks_per_request:.1f} blocks a request from host")
        reuse = f"  ({'; '.join(notes)})" if notes else ""
        rows.append(
            f"{r.layout.name:24} {r.layout.devices:7d} {r.attainment:7.1%} {r.goodput:9.2f} "
            f"{_ms(r.ttft_s.get('p50'))} {_ms(r.ttft_s.get('p90'))} "
            f"{_ms(r.tpot_s.get('p50'))} {_ms(r.tpot_s.get('p90'))}  "
            f"{'yes' if r.meets(slo) else 'no'}{reuse}"
        )
    return "\n".join(rows)


def _ms(seconds: float | None) -> str:
    return f"{'-':>9}" if seconds is None else f"{seconds * 1000:7.1f}ms"


def write_plot(
    path: Path, sweeps: dict[str, list[LayoutResult]], target_rate: float
) -> Path | None:
    """Goodput against offered rate, one line per layout; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, results in sweeps.items():
        axes.plot([r.rate for r in results], [r.goodput for r in results], marker="o", label=name)
    axes.axvline(target_rate, color="grey", linestyle="--", label="target rate")
    axes.set_xlabel("offered rate (requests/s)")
    axes.set_ylabel("goodput (requests/s within both SLOs)")
    axes.legend(fontsize="small")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def deploy_snippet(layout: Layout, model: str, gpus_per_node: int) -> str:
    """KubeRay worker groups (deploy/kuberay/raycluster.yaml) for ``layout``: pods of
    ``gpus_per_node`` GPUs per pool, and the serve flags with the pools' resources."""
    lines = [f"# pdserve plan: {layout.name} for {model}", "workerGroupSpecs:"]
    pools = [("decode", layout.num_decode, layout.decode_tp)]
    if layout.num_prefill:
        pools.insert(0, ("prefill", layout.num_prefill, layout.prefill_tp))
    for group, count, tp in pools:
        per_pod = max(1, gpus_per_node // tp)
        pods = -(-count // per_pod)
        lines += [
            f"  - groupName: {group}",
            f"    replicas: {pods}",
            f"    minReplicas: {pods}",
            f"    # {count} worker(s) of {tp} GPU(s), {per_pod} per {gpus_per_node}-GPU pod",
            f'    rayStartParams: {{resources: \'"{{\\"{group}\\": {gpus_per_node}}}"\'}}',
        ]
    flags = layout.serve_flags()
    if layout.num_prefill:
        flags += ["--prefill-resource", "prefill", "--decode-resource", "decode"]
    else:
        flags += ["--decode-resource", "decode"]
    lines.append(f'serveArgs: "{" ".join(flags)}"')
    return "\n".join(lines) + "\n"
