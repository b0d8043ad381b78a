"""``python -m bench.serve``: command-line front end to ``run_benchmark`` and ``sweep``."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.serving.arrivals import ArrivalSpec
from bench.serving.client import EndpointConfig
from bench.serving.metrics import SLO
from bench.serving.report import (
    plot_latency_cdfs,
    plot_sweep,
    rate_label,
    result_dict,
    summary_table,
    sweep_dict,
    turn_table,
    write_json,
)
from bench.serving.runner import BenchConfig, BenchmarkError, run_benchmark, sweep
from bench.serving.workloads import WORKLOAD_KINDS, WorkloadSpec

EXAMPLE = """example:
  python -m bench.serve --base-url http://127.0.0.1:8123/v1 --model pdserve-demo \\
      --tokenizer engine/demo_model/assets --workload chat-like --input-len 64 \\
      --output-len 32 --input-range 8,256 --output-range 4,128 --num-prompts 40 \\
      --request-rates 1,2,4 --slo-ttft-ms 500 --slo-tpot-ms 50 \\
      --result-json bench/results/serve.json --plot-dir bench/results/serve
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.serve",
        description="Load-test an OpenAI-compatible server with streamed requests.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    target.add_argument("--model", required=True, help="served model name")
    target.add_argument("--api-key", default=None, help="sent as Authorization: Bearer")
    target.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    target.add_argument("--tokenizer", default=None, help="HF tokenizer dir (default: --model)")
    target.add_argument("--temperature", type=float, default=0.0)
    target.add_argument("--no-ignore-eos", action="store_true", help="let EOS end outputs")
    target.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout")

    work = parser.add_argument_group("workload (lengths in tokens)")
    work.add_argument("--workload", choices=WORKLOAD_KINDS, default="fixed")
    work.add_argument("--input-len", type=int, default=128, help="fixed; chat-like median")
    work.add_argument("--output-len", type=int, default=128, help="fixed/shared-prefix; median")
    work.add_argument("--input-range", type=int_pair, default=(32, 1024), metavar="MIN,MAX")
    work.add_argument("--output-range", type=int_pair, default=(16, 512), metavar="MIN,MAX")
    work.add_argument("--input-sigma", type=float, default=1.0, help="chat-like log std-dev")
    work.add_argument("--output-sigma", type=float, default=0.8, help="chat-like log std-dev")
    work.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix prompts")
    work.add_argument("--prefix-len", type=int, default=256, help="shared-prefix length")
    work.add_argument("--suffix-range", type=int_pair, default=(16, 64), metavar="MIN,MAX")
    work.add_argument("--num-conversations", type=int, default=64, help="multi-turn")
    work.add_argument("--num-turns", type=int, default=6, help="multi-turn: per conversation")
    work.add_argument("--system-prompt-len", type=int, default=1000, help="multi-turn: shared")
    work.add_argument(
        "--user-range", type=int_pair, default=(50, 200), metavar="MIN,MAX", help="multi-turn"
    )
    work.add_argument(
        "--reply-range", type=int_pair, default=(100, 200), metavar="MIN,MAX", help="multi-turn"
    )
    work.add_argument("--num-prompts", type=int, default=100)
    work.add_argument("--seed", type=int, default=0)

    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate", type=float, default=math.inf, help="req/s or inf (multi-turn: conv/s)"
    )
    load.add_argument("--request-rates", type=_float_list, default=None, help="sweep: 1,2,4,inf")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    load.add_argument(
        "--max-concurrency", type=int, default=None, help="in-flight bound (with rate inf: fixed)"
    )
    load.add_argument("--num-warmups", type=int, default=1, help="untimed requests first")

    out = parser.add_argument_group("SLOs and output")
    out.add_argument("--slo-ttft-ms", type=float, default=None)
    out.add_argument("--slo-tpot-ms", type=float, default=None)
    out.add_argument("--percentiles", type=_float_list, default=(50.0, 90.0, 99.0))
    out.add_argument(
        "--server-counters",
        action="store_true",
        help="read the server's /metrics before and after: prefill tokens, prefix hit rate",
    )
    out.add_argument("--result-json", type=Path, default=None)
    out.add_argument("--plot-dir", type=Path, default=None)
    out.add_argument("--no-progress", action="store_true")
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    endpoint = EndpointConfig(
        base_url=args.base_url,
        model=args.model,
        api_key=args.api_key,
        endpoint=args.endpoint,
        temperature=args.temperature,
        ignore_eos=not args.no_ignore_eos,
        timeout_s=args.timeout_s,
    )
    workload = WorkloadSpec(
        kind=args.workload,
        input_len=args.input_len,
        output_len=args.output_len,
        input_range=args.input_range,
        output_range=args.output_range,
        input_sigma=args.input_sigma,
        output_sigma=args.output_sigma,
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        suffix_range=args.suffix_range,
        num_conversations=args.num_conversations,
        num_turns=args.num_turns,
        system_prompt_len=args.system_prompt_len,
        user_range=args.user_range,
        reply_range=args.reply_range,
    )
    if workload.kind == "multi-turn" and endpoint.endpoint != "completions":
        raise ValueError("the multi-turn workload sends token ids: use --endpoint completions")
    return BenchConfig(
        endpoint=endpoint,
        tokenizer_dir=args.tokenizer or args.model,
        workload=workload,
        arrivals=ArrivalSpec(args.request_rate, args.burstiness, args.max_concurrency),
        slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms),
        num_prompts=args.num_prompts,
        seed=args.seed,
        num_warmups=args.num_warmups,
        percentiles=tuple(args.percentiles),
        progress=not args.no_progress,
        server_counters=args.server_counters,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    try:
        if args.request_rates:
            result = sweep(config, args.request_rates)
            runs = list(result.runs)
            payload = sweep_dict(result)
        else:
            runs = [run_benchmark(config)]
            payload = result_dict(runs[0])
    except BenchmarkError as error:
        print(f"bench.serve: {error}", file=sys.stderr)
        return 1
    print(summary_table(runs))
    for run in runs:
        if run.reply_token_ids is not None:  # multi-turn
            print(f"\nrate {rate_label(run.config.arrivals.request_rate)}:\n{turn_table(run)}")
    if args.result_json is not None:
        print(f"wrote {write_json(args.result_json, payload)}")
    if args.plot_dir is not None:
        for run in runs:
            name = f"latency_cdf_rate-{rate_label(run.config.arrivals.request_rate)}.png"
            print(f"wrote {plot_latency_cdfs(run, args.plot_dir / name)}")
        if args.request_rates:
            print(f"wrote {plot_sweep(result, args.plot_dir / 'sweep.png')}")
    return 0


def int_pair(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    try:
        return int(low), int(high or low)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX integers, got {text!r}") from error


def _float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,inf, got {text!r}") from error
