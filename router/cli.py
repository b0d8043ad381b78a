"""The ``pdserve`` command line.

  pdserve generate --model DIR --prompt "..." --max-tokens N   one-off offline generation
  pdserve serve --model DIR --prefill N --decode M             the disaggregated cluster on Ray
  pdserve demo                                                 the offline engine on a tiny model

The engine (and torch) are imported only inside the commands that run a model, so the router
stays importable on a CPU head node without torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from router.cluster_config import ClusterConfig
from router.policies import POLICY_NAMES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate a completion offline")
    gen.add_argument("--model", required=True, help="Hugging Face model directory")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--n", type=int, default=1)
    _add_engine_args(gen)

    serve = commands.add_parser("serve", help="start a prefill/decode cluster on Ray")
    serve.add_argument("--model", required=True, help="Hugging Face model directory")
    serve.add_argument("--prefill", type=int, default=1, help="prefill workers (0: colocated)")
    serve.add_argument("--decode", type=int, default=1, help="decode workers")
    serve.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    serve.add_argument("--dtype", default="auto")
    serve.add_argument("--address", default=None, help="'auto' joins a running Ray cluster")
    serve.add_argument("--router-policy", default="least_loaded", choices=list(POLICY_NAMES))
    serve.add_argument(
        "--kv-transport", default="gloo", choices=["gloo", "shm", "nccl", "cuda_ipc"]
    )
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument("--max-num-seqs", type=int, default=256)
    serve.add_argument("--max-num-batched-tokens", type=int, default=2048)
    serve.add_argument("--num-kv-blocks", type=int, default=None)
    serve.add_argument("--worker-num-cpus", type=float, default=1.0)
    serve.add_argument(
        "--worker-num-gpus",
        type=float,
        default=None,
        help="GPUs per worker (default 1 on cuda; fractions share a GPU)",
    )
    serve.add_argument(
        "--prefill-resource",
        default=None,
        help="Ray custom resource each prefill worker needs one unit of (e.g. 'prefill')",
    )
    serve.add_argument(
        "--decode-resource",
        default=None,
        help="Ray custom resource each decode worker needs one unit of (e.g. 'decode')",
    )
    serve.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="generate for these prompts and exit (default: read prompts from stdin)",
    )
    serve.add_argument("--max-tokens", type=int, default=64)
    serve.add_argument("--temperature", type=float, default=0.0)

    demo = commands.add_parser("demo", help="build a tiny random model and generate with it")
    demo.add_argument("--workdir", default=None, help="where to write the demo model")
    demo.add_argument("--max-tokens", type=int, default=24)
    return parser


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda if present)")
    parser.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")


def _run_generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        n=args.n,
    )
    for output in llm.generate(args.prompt, params):
        for completion in output.outputs:
            print(f"{output.prompt}{completion.text}")
            print(f"  [{completion.finish_reason}; {len(completion.token_ids)} tokens]")
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    from router.serve_repl import serve

    num_gpus = args.worker_num_gpus
    if num_gpus is None:
        num_gpus = 1.0 if args.device == "cuda" else 0.0
    config = ClusterConfig(
        model_dir=args.model,
        num_prefill=args.prefill,
        num_decode=args.decode,
        device=args.device,
        dtype=args.dtype,
        address=args.address,
        router_policy=args.router_policy,
        kv_transport=args.kv_transport,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks,
        worker_num_cpus=args.worker_num_cpus,
        worker_num_gpus=num_gpus,
        prefill_resources={args.prefill_resource: 1.0} if args.prefill_resource else {},
        decode_resources={args.decode_resource: 1.0} if args.decode_resource else {},
    )
    return serve(config, args.prompt, args.max_tokens, args.temperature)


def _run_demo(args: argparse.Namespace) -> int:
    from engine.demo_model.offline_demo import run_demo

    run_demo(args.workdir, args.max_tokens)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _run_generate(args)
        if args.command == "serve":
            return _run_serve(args)
        return _run_demo(args)
    except ValueError as error:
        print(f"pdserve: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())


def console_main() -> None:
    sys.exit(main())
