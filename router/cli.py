"""The ``pdserve`` command line.

  pdserve generate --model DIR --prompt "..." --max-tokens N   one-off offline generation
  pdserve serve [--model DIR] --prefill N --decode M           the cluster with its HTTP/gRPC APIs
  pdserve demo                                                 the offline engine on the demo model

The engine (and torch) are imported only inside the commands that run a model, so the router
stays importable on a CPU head node without torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence

from engine.cpu_features import cpu_flags
from engine.engine_config import ATTENTION_BACKENDS
from engine.kv_cache.kv_quantization import parse_kv_cache_dtype
from engine.scheduler import SCHEDULING_POLICIES
from engine.speculative.config import SpeculativeConfig
from kv_transfer.policy import describe_auto
from router.cluster_config import ClusterConfig
from router.gateway.reasoning import REASONING_PARSERS
from router.gateway.slo_admission import ADMISSION_MODES, AdmissionPolicy
from router.gateway.tool_calls import TOOL_CALL_PARSERS
from router.kv_aware import KVAwareWeights
from router.local_prefill import LocalPrefillRule
from router.planner.command import add_plan_args, run_plan
from router.planner.profile_command import add_profile_args, run_profile
from router.policies import POLICY_NAMES
from router.rebalance_policy import RebalanceConfig
from router.serve_defaults import demo_model_dtype, pick_layout, step_budget

# --max-body-bytes at most: the gRPC server's receive limit is twice it, in a C int
# (router/gateway/grpc_service.py), and 1 GiB overflowed it
MAX_BODY_BYTES = 512 << 20

_SPECULATIVE_HELP = (
    "speculative decoding, as vLLM's JSON: "
    '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' drafts up '
    "to num_speculative_tokens tokens per step, those that followed the latest earlier "
    "occurrence of the sequence's last n tokens in its prompt and output (n from "
    "prompt_lookup_max down to prompt_lookup_min; either alone sets both, neither: 5); "
    '\'{"model": "/path/to/small-model", "num_speculative_tokens": 4}\' (method draft_model) '
    "drafts them greedily with that smaller model of the same vocabulary, on the decode "
    'workers; \'{"method": "mtp", "num_speculative_tokens": 1}\' with the model\'s own '
    "multi-token-prediction layer (DeepSeek-V3, GLM-4.5); each keeps the drafts the model "
    "agrees with (greedy output is unchanged, sampled output keeps the model's distribution; "
    "default: off)"
)
_EXPERT_PARALLEL_HELP = (
    "a mixture-of-experts model's routed experts dealt out whole over each worker's "
    "tensor-parallel ranks (a run of experts per rank) instead of every rank holding a slice "
    "of every expert: for expert widths or quantized blocks the ranks cannot split"
)


_TRUST_REMOTE_CODE = (
    "let a tokenizer that ships as code in the model directory run it (Kimi K2's tiktoken "
    "tokenizer), as vLLM's flag; without it such a model is refused at start"
)


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
    gen.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="ranks (processes of this machine) holding 1/N of the weights and KV heads each",
    )
    gen.add_argument("--enable-expert-parallel", action="store_true", help=_EXPERT_PARALLEL_HELP)
    _add_engine_args(gen)
    gen.add_argument(
        "--speculative-config",
        type=speculative_config,
        default=None,
        metavar="JSON",
        help=_SPECULATIVE_HELP,
    )

    serve = commands.add_parser(
        "serve", help="start the cluster with its OpenAI HTTP gateway and gRPC service"
    )
    _add_serve_args(serve)

    demo = commands.add_parser("demo", help="generate with the bundled demo model, offline")
    demo.add_argument("--max-tokens", type=int, default=24)

    plan = commands.add_parser(
        "plan",
        help="the cheapest layout (colocated xN, or xPyD with TP sizes) that serves a workload "
        "within its SLOs, by simulating each with the workers' own scheduler",
    )
    add_plan_args(plan)
    profile = commands.add_parser(
        "profile",
        help="measure this machine's step times for a model (a hardware profile for pdserve plan)",
    )
    add_profile_args(profile)
    return parser


def _add_serve_args(serve: argparse.ArgumentParser) -> None:
    cluster = serve.add_argument_group("cluster")
    cluster.add_argument(
        "--model", default=None, help="Hugging Face model directory (default: the bundled demo)"
    )
    cluster.add_argument(
        "--prefill",
        type=int,
        default=None,
        help="prefill workers (0: colocated). Without --prefill and --decode: 1 prefill + 1 "
        "decode worker, or, on a CPU machine of fewer than 3 cores running its own Ray, one "
        "colocated worker bound to all cores but one (router.serve_defaults.py)",
    )
    cluster.add_argument("--decode", type=int, default=None, help="decode workers (default 1)")
    cluster.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    cluster.add_argument("--dtype", default="auto")
    cluster.add_argument(
        "--attention-backend",
        default="auto",
        choices=list(ATTENTION_BACKENDS),
        help="auto: Triton kernels on cuda; on cpu the C prefill and decode kernels (built with cc on first use), else the torch reference",
    )
    _add_kv_cache_dtype(cluster)
    cluster.add_argument(
        "--kv-offload-gb",
        type=float,
        default=0.0,
        help="GiB of host memory per worker rank (pinned on cuda) that keeps the blocks its KV "
        "cache evicts, LRU; a prefix hit there is copied back instead of recomputed, and the "
        "router routes by it (docs/kv-offload.md). Default 0: none",
    )
    cluster.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs of decode steps (cuda only)"
    )
    cluster.add_argument("--trust-remote-code", action="store_true", help=_TRUST_REMOTE_CODE)
    cluster.add_argument("--address", default=None, help="'auto' joins a running Ray cluster")
    cluster.add_argument(
        "--node-ip",
        default=None,
        help="this node's address for Ray. Without --address, the local Ray's processes (and "
        "the workers' KV data plane) listen on 127.0.0.1 only, unless this names another "
        "address, which makes Ray listen on every interface; with --address, default: the "
        "node's cluster address as Ray finds it",
    )
    cluster.add_argument(
        "--router-policy",
        default="kv_aware",
        choices=list(POLICY_NAMES),
        help="kv_aware (default): each prompt to the prefill worker whose cache holds most of "
        "it, weighed against its queue, as the workers' own KV events tell (docs/kv-routing.md)",
    )
    cluster.add_argument(
        "--kv-aware-queue-weight",
        type=float,
        default=KVAwareWeights().queue_weight,
        help="kv_aware: how many of a prompt's own tokens to compute one queued prompt token "
        "of a worker is worth (default %(default)s)",
    )
    cluster.add_argument(
        "--kv-aware-host-hit-weight",
        type=float,
        default=KVAwareWeights().host_hit_weight,
        help="kv_aware: what a prompt token found in a worker's host tier costs, as a fraction "
        "of computing it (default %(default)s)",
    )
    cluster.add_argument(
        "--kv-aware-local-prefill-weight",
        type=float,
        default=KVAwareWeights().local_prefill_weight,
        help="kv_aware: what a prompt token computed on a decode worker that holds the rest of "
        "the prompt (a conversation's earlier turns) costs, in tokens computed on a prefill "
        "worker (default %(default)s)",
    )
    cluster.add_argument(
        "--kv-aware-move-weight",
        type=float,
        default=KVAwareWeights().move_weight,
        help="kv_aware: what a prompt token whose KV a prefill worker copies from a decode "
        "worker's cache costs, as a fraction of computing it (default %(default)s)",
    )
    cluster.add_argument(
        "--kv-aware-holder-kv-limit",
        type=float,
        default=KVAwareWeights().holder_kv_limit,
        help="kv_aware: a decode worker whose KV usage has reached this fraction is sent no "
        "more prompts for the prefix it caches (default %(default)s)",
    )
    cluster.add_argument(
        "--kv-transport",
        default="auto",
        choices=["auto", "gloo", "shm", "nccl", "cuda_ipc"],
        help=f"auto: per prefill -> decode pair, on cpu {describe_auto('cpu')}; "
        f"on cuda {describe_auto('cuda')}",
    )
    cluster.add_argument(
        "--kv-transfer-checksum",
        action="store_true",
        help="the decode worker checks a CRC32 of every KV transfer against the prefill "
        "worker's and fails the transfer on a mismatch (verification runs: it reads the KV "
        "back to the host on both ends)",
    )
    cluster.add_argument("--block-size", type=int, default=16)
    cluster.add_argument("--max-num-seqs", type=int, default=256)
    cluster.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="each worker's step budget in tokens (default 2048; 512 on cpu)",
    )
    cluster.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=list(SCHEDULING_POLICIES),
        help="the order each worker serves its requests in, as vLLM's: fcfs (arrival; a "
        "request's priority must be 0) or priority (the request's priority field, lower "
        "first, then arrival)",
    )
    cluster.add_argument(
        "--async-scheduling",
        action="store_true",
        help="each worker schedules and launches a step before the step before it has given "
        "its tokens, as vLLM's: the host's work overlaps the forward (not with "
        "--speculative-config)",
    )
    cluster.add_argument(
        "--prefill-max-num-batched-tokens",
        type=int,
        default=None,
        help="the prefill pool's step budget (default: --max-num-batched-tokens); a smaller "
        "one starts each arriving prompt sooner, at the same cost per token",
    )
    cluster.add_argument(
        "--max-local-prefill-length",
        type=int,
        default=0,
        help="disaggregated: prompts of at most this many tokens are prefilled on their decode "
        "worker, with no KV hand-off (default 0: none)",
    )
    cluster.add_argument(
        "--max-prefill-queue-tokens",
        type=int,
        default=None,
        help="disaggregated: while every prefill worker has more prompt tokens than this "
        "queued, a new prompt is prefilled on its decode worker if that one is prefilling "
        "nothing (one at a time; default: never)",
    )
    cluster.add_argument(
        "--rebalance",
        action="store_true",
        help="move workers between the prefill and decode pools when one pool is the "
        "bottleneck (its predicted TTFT or TPOT near --slo-ttft-ms / --slo-tpot-ms) while the "
        "other has room to spare, for --rebalance-window-s (as many as the shift needs, "
        "--rebalance-max-moves); each drains, finishes or hands on what it holds (no request "
        "fails) and restarts in the other role; at most one switch "
        "per --rebalance-cooldown-s, one worker kept per pool (router/rebalancer.py)",
    )
    cluster.add_argument(
        "--rebalance-max-moves",
        type=_int_in(1),
        default=None,
        help="workers one switch moves at most (pools of different TP sizes: exchanges); "
        "default: as many as bring the bottleneck pool's projected pressure to 0.7 of its SLO "
        "while the giving pool's stays at most that",
    )
    cluster.add_argument(
        "--rebalance-window-s",
        type=float,
        default=10.0,
        help="how long a pool must be the bottleneck before a worker switches (default: 10)",
    )
    cluster.add_argument(
        "--rebalance-cooldown-s",
        type=float,
        default=60.0,
        help="no switch for this long after one (default: 60)",
    )
    cluster.add_argument(
        "--rebalance-drain-timeout-s",
        type=float,
        default=30.0,
        help="a switching worker's requests still running after this long are resumed on the "
        "other workers (default: 30)",
    )
    cluster.add_argument(
        "--rebalance-place-timeout-s",
        type=float,
        default=120.0,
        help="pools of different --prefill-tp and --decode-tp: a switching worker's processes "
        "stop and a worker of the other pool's size starts; if Ray has not placed its ranks "
        "after this long (no node has room), a worker of the old role starts in their place "
        "(default: 120; an autoscaler adds a node in minutes)",
    )
    cluster.add_argument(
        "--max-worker-restarts",
        type=_int_in(0),
        default=10,
        help="a worker whose process dies is replaced by a new one, up to this many times per "
        "worker (0: never); a failed start doubles the wait before the next (1 s up to 60 s)",
    )
    cluster.add_argument(
        "--worker-dead-after-s",
        type=float,
        default=30.0,
        help="a worker silent this long is taken out of rotation and its requests re-routed "
        "(one whose process is gone is out at once; one merely slow to report is routed to "
        "last, and while a whole pool is slow, requests wait for it)",
    )
    cluster.add_argument("--num-kv-blocks", type=int, default=None)
    cluster.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="cuda: the fraction of each GPU the workers on it use together for weights, "
        "activations and KV cache; a worker of --worker-num-gpus 0.5 takes half of it",
    )
    cluster.add_argument("--max-model-len", type=int, default=None)
    cluster.add_argument(
        "--worker-num-cpus",
        type=float,
        default=None,
        help="Ray CPUs per worker, its torch threads (default 1; the colocated layout picked "
        "on a small CPU machine: all cores but one)",
    )
    cluster.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="ranks per worker (one Ray actor each, placed on one node), each holding 1/N of "
        "the weights and KV heads; --prefill-tp and --decode-tp set one pool's",
    )
    cluster.add_argument(
        "--prefill-tp", type=int, default=None, help="ranks per prefill worker (see -tp)"
    )
    cluster.add_argument(
        "--decode-tp",
        type=int,
        default=None,
        help="ranks per decode (and colocated) worker (see -tp)",
    )
    cluster.add_argument(
        "--enable-expert-parallel", action="store_true", help=_EXPERT_PARALLEL_HELP
    )
    cluster.add_argument(
        "--bind-worker-cpus",
        action="store_true",
        help="local Ray only: each worker's threads on cores of their own, the gateway and "
        "Ray on the cores left (at least one must be)",
    )
    cluster.add_argument(
        "--worker-num-gpus",
        type=float,
        default=None,
        help="GPUs per worker (default 1 on cuda; fractions share a GPU)",
    )
    cluster.add_argument(
        "--prefill-resource",
        default=None,
        help="Ray custom resource each prefill worker needs one unit of (e.g. 'prefill')",
    )
    cluster.add_argument(
        "--decode-resource",
        default=None,
        help="Ray custom resource each decode worker needs one unit of (e.g. 'decode')",
    )
    cluster.add_argument(
        "--speculative-config",
        type=speculative_config,
        default=None,
        metavar="JSON",
        help=_SPECULATIVE_HELP + "; the decode workers (colocated ones too) speculate",
    )
    front = serve.add_argument_group("front doors")
    front.add_argument("--host", default="127.0.0.1", help="address the HTTP and gRPC servers bind")
    front.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM or Ctrl-C: new requests get 503 and requests in flight get this long "
        "to finish before they are ended with an error; a second signal ends the wait at once",
    )
    front.add_argument("--http-port", type=_int_in(0, 65535), default=8000, help="0: any free port")
    front.add_argument(
        "--grpc-port",
        type=_int_in(-1, 65535),
        default=50051,
        help="-1 disables gRPC; 0: any free port",
    )
    front.add_argument("--served-model-name", default=None, help="the model id clients send")
    front.add_argument("--api-key", action="append", default=None, help="a bearer key (repeatable)")
    front.add_argument("--api-key-file", default=None, help="one API key per line")
    front.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="allow binding a non-loopback --host without API keys",
    )
    front.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=1000.0,
        help="time-to-first-token SLO (goodput, and --admission slo)",
    )
    front.add_argument(
        "--slo-tpot-ms",
        type=float,
        default=100.0,
        help="time-per-output-token SLO (goodput, and --admission slo)",
    )
    front.add_argument(
        "--admission",
        choices=ADMISSION_MODES,
        default="none",
        help="slo: refuse at once (429 with Retry-After) a request whose prompts are predicted "
        "to miss --slo-ttft-ms or --slo-tpot-ms on their best placement, and, on a loaded "
        "server, a request of an API key holding more than its fair share; the prediction is "
        "the router's latency model, fitted from the workers' step timings "
        "(router/gateway/slo_admission.py; default: none, only --max-concurrent-requests)",
    )
    front.add_argument(
        "--admission-margin",
        type=float,
        default=AdmissionPolicy().margin,
        help="--admission slo refuses a request predicted to miss an SLO by more than this "
        "fraction of it (default: %(default)s)",
    )
    front.add_argument(
        "--admission-fair-share-after",
        type=float,
        default=AdmissionPolicy().fair_share_after,
        help="--admission slo refuses the requests of a key over its fair share of those in "
        "flight once a prompt's predicted TTFT passes this fraction of --slo-ttft-ms "
        "(default: %(default)s)",
    )
    front.add_argument(
        "--admission-attainment",
        type=float,
        default=AdmissionPolicy().attainment,
        help="--admission slo admits a request when it is predicted to make its SLOs in this "
        "share of cases: the prediction plus this quantile of recent requests' errors; while "
        "fewer of the requests it admitted met their SLOs, it judges by SLOs scaled down "
        "(pdserve:admission_slo_scale) (default: %(default)s)",
    )
    front.add_argument(
        "--latency-profile",
        action="store_true",
        help="each worker runs a few synthetic requests at start-up so that the router's "
        "latency model predicts from the first request on (always with --admission slo; "
        "otherwise it predicts once the workers have run enough steps of real traffic)",
    )
    front.add_argument(
        "--first-token-trace",
        default=None,
        metavar="PATH",
        help="append one JSON line per prompt of an HTTP request to PATH: when its first token "
        "passed each hop from arrival to its first chunk written, and the seconds each hop "
        "took (docs/request_path.md); the hops' histogram, pdserve:first_token_hop_seconds, is "
        "at /metrics either way (default: off)",
    )
    tools = serve.add_argument_group("tool calling")
    tools.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" (OpenAI\'s default when a chat sends tools): the model '
        "writes freely and its text is read for tool calls in the --tool-call-parser format, "
        'which it needs (without it "auto" is refused, as vLLM refuses it)',
    )
    tools.add_argument(
        "--tool-call-parser",
        default=None,
        choices=list(TOOL_CALL_PARSERS),
        help="the format the model writes tool calls in, for --enable-auto-tool-choice: hermes "
        '(<tool_call>{"name": ..., "arguments": ...}</tool_call>, as Hermes, Qwen2.5 and Qwen3 '
        'write them), llama3_json or llama4_json ({"name": ..., "parameters": ...}, Llama 3.1+ '
        "and 4), mistral ([TOOL_CALLS][{...}] before v11 tokenizers, [TOOL_CALLS]name[ARGS]{...} "
        "from v11), deepseek_v3 (<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME and fenced JSON: "
        "DeepSeek-V3, R1-0528), deepseek_v31 (<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}: "
        "DeepSeek-V3.1 and later), kimi_k2 (<|tool_call_begin|>functions.NAME:INDEX"
        "<|tool_call_argument_begin|>{...}: Kimi K2; its ids kept), qwen3_coder or qwen3_xml "
        "(<tool_call><function=NAME>"
        "<parameter=KEY>value</parameter>...: Qwen3-Coder; values typed by the tool's schema), "
        "glm45 or glm47 (<tool_call>NAME<arg_key>KEY</arg_key><arg_value>value</arg_value>...: "
        "GLM-4.5 to 4.7; values typed by the tool's schema), minimax_m2 (<minimax:tool_call>"
        "<invoke name=NAME><parameter name=KEY>value</parameter>...: MiniMax-M2; values typed by "
        "the tool's schema), pythonic or llama4_pythonic ([name(key=value, ...), ...]: Llama "
        "3.2 and 4 with pythonic templates, ToolACE), openai (gpt-oss: its harmony messages to functions.NAME; "
        "needs --reasoning-parser openai_gptoss, a gpt_oss model's default)",
    )
    reasoning = serve.add_argument_group("reasoning")
    reasoning.add_argument(
        "--reasoning-parser",
        default=None,
        choices=list(REASONING_PARSERS),
        help="split chat output into message.reasoning (the thought, between <think> and "
        "</think>) and content, as vLLM's parser of the same name: deepseek_r1 (DeepSeek-R1, "
        "QwQ), deepseek_v3 (DeepSeek-V3.1: thinks when chat_template_kwargs thinking is true), "
        "qwen3 (Qwen3, Qwen3.5; chat_template_kwargs enable_thinking false: all content), "
        "glm45 (GLM-4.5 to 4.7: as qwen3, enable_thinking or thinking false: all content), "
        "kimi_k2 (Kimi K2 Thinking: as qwen3, its calls' section ending the thought; "
        "chat_template_kwargs thinking false: all content), minimax_m2 (MiniMax-M2: as "
        "deepseek_r1), minimax_m2_append_think (the thought kept in the content, <think> first), "
        "openai_gptoss (gpt-oss's harmony messages: the analysis channel is the reasoning, the "
        "final channel the content; a gpt_oss model's default)",
    )
    limits = serve.add_argument_group("request limits")
    limits.add_argument("--max-body-bytes", type=_int_in(1, MAX_BODY_BYTES), default=4 << 20)
    limits.add_argument(
        "--max-output-tokens", type=_int_in(1), default=None, help="cap on a request's max_tokens"
    )
    limits.add_argument(
        "--max-n",
        type=_int_in(1),
        default=None,
        help="samples per prompt, at most --max-num-seqs (default: 16, or --max-num-seqs if fewer)",
    )
    limits.add_argument("--max-stop-strings", type=_int_in(1), default=16)
    limits.add_argument("--max-messages", type=_int_in(1), default=256)
    limits.add_argument("--max-concurrent-requests", type=_int_in(1), default=512)
    limits.add_argument(
        "--responses-store-size",
        type=_int_in(0),
        default=0,
        help="keep the last N /v1/responses responses in the gateway's memory (each readable "
        "by its own API key only) for previous_response_id and GET /v1/responses/{id}; "
        "0: keep none (vLLM's default)",
    )
    oneshot = serve.add_argument_group("one-shot mode")
    oneshot.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="generate for these prompts through the cluster and exit (no servers)",
    )
    oneshot.add_argument("--max-tokens", type=_int_in(1), default=64)
    oneshot.add_argument("--temperature", type=float, default=0.0)


def speculative_config(text: str) -> SpeculativeConfig:
    """An argparse type: vLLM's ``speculative_config`` JSON object, checked (argparse's error
    names the flag; ours the field)."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error}): {text!r}") from None
    if not isinstance(raw, dict):
        raise argparse.ArgumentTypeError(
            f"must be a JSON object such as '{{\"num_speculative_tokens\": 4}}', "
            f"got {type(raw).__name__}"
        )
    try:
        return SpeculativeConfig.from_mapping(raw)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (argparse's error names the flag)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value

    return parse


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
    parser.add_argument("--trust-remote-code", action="store_true", help=_TRUST_REMOTE_CODE)
    _add_kv_cache_dtype(parser)


def _add_kv_cache_dtype(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8", "fp8_e4m3", "int8"],
        help="what the KV cache stores: auto (the model's dtype), fp8 / fp8_e4m3 or int8 "
        "(half of bf16's bytes; static scales per layer and KV head, from the checkpoint's "
        "k_scale/v_scale or calibrated at start-up: docs/quantized-kv-cache.md)",
    )


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
        kv_cache_dtype=args.kv_cache_dtype,
        speculative_config=args.speculative_config,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        trust_remote_code=args.trust_remote_code,
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
    from router.serve_command import run_serve

    _log_with_times()
    model, dtype, name = args.model, args.dtype, args.served_model_name
    if model is None:  # the bundled demo model (bfloat16 on disk)
        from engine.demo_model import DEMO_MODEL_DIR, DEMO_MODEL_NAME

        model, name = str(DEMO_MODEL_DIR), name or DEMO_MODEL_NAME
        if dtype == "auto":
            dtype = demo_model_dtype(args.device, cpu_flags())
    args.served_model_name = name
    num_gpus = args.worker_num_gpus
    if num_gpus is None:
        num_gpus = 1.0 if args.device == "cuda" else 0.0
    prefill_tp = args.tensor_parallel_size if args.prefill_tp is None else args.prefill_tp
    decode_tp = args.tensor_parallel_size if args.decode_tp is None else args.decode_tp
    layout = pick_layout(
        args.prefill,
        args.decode,
        device=args.device,
        joins_cluster=args.address is not None,
        num_cores=len(os.sched_getaffinity(0)),
        worker_num_cpus=args.worker_num_cpus,
        bind_worker_cpus=args.bind_worker_cpus,
        tensor_parallel=max(prefill_tp, decode_tp) > 1,
    )
    if layout.reason:
        print(f"pdserve: one colocated worker ({layout.reason})", flush=True)
    config = ClusterConfig(
        model_dir=model,
        num_prefill=layout.num_prefill,
        num_decode=layout.num_decode,
        device=args.device,
        dtype=dtype,
        attention_backend=args.attention_backend,
        kv_cache_dtype=parse_kv_cache_dtype(args.kv_cache_dtype),
        kv_offload_gb=args.kv_offload_gb,
        enforce_eager=args.enforce_eager,
        trust_remote_code=args.trust_remote_code,
        address=args.address,
        node_ip=args.node_ip,
        router_policy=args.router_policy,
        kv_aware=KVAwareWeights(
            args.kv_aware_queue_weight,
            args.kv_aware_host_hit_weight,
            args.kv_aware_local_prefill_weight,
            args.kv_aware_move_weight,
            args.kv_aware_holder_kv_limit,
        ),
        kv_transport=args.kv_transport,
        kv_transfer_checksum=args.kv_transfer_checksum,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=step_budget(args.max_num_batched_tokens, args.device),
        scheduling_policy=args.scheduling_policy,
        async_scheduling=args.async_scheduling,
        prefill_max_num_batched_tokens=args.prefill_max_num_batched_tokens,
        local_prefill=LocalPrefillRule(
            args.max_local_prefill_length, args.max_prefill_queue_tokens
        ),
        num_kv_blocks=args.num_kv_blocks,
        max_worker_restarts=args.max_worker_restarts,
        dead_after_s=args.worker_dead_after_s,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        expert_parallel=args.enable_expert_parallel,
        worker_num_cpus=layout.worker_num_cpus,
        worker_num_gpus=num_gpus,
        bind_worker_cpus=layout.bind_worker_cpus,
        prefill_resources={args.prefill_resource: 1.0} if args.prefill_resource else {},
        decode_resources={args.decode_resource: 1.0} if args.decode_resource else {},
        speculative=args.speculative_config,
        latency_profile=args.latency_profile or args.admission == "slo" or args.rebalance,
        rebalance=rebalance_config(args),
    )
    return run_serve(args, config)


def _log_with_times() -> None:
    """The server's warnings and errors (a worker lost, a role switch, a refused forecast) on
    stderr, each with its time and logger; a root logger configured already (a program that
    embeds the server) is left as it is."""
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def rebalance_config(args: argparse.Namespace) -> RebalanceConfig | None:
    """The rebalancer's settings from ``serve``'s flags; None without ``--rebalance``."""
    if not args.rebalance:
        return None
    return RebalanceConfig(
        args.slo_ttft_ms / 1000,
        args.slo_tpot_ms / 1000,
        window_s=args.rebalance_window_s,
        cooldown_s=args.rebalance_cooldown_s,
        drain_timeout_s=args.rebalance_drain_timeout_s,
        place_timeout_s=args.rebalance_place_timeout_s,
        max_moves=args.rebalance_max_moves,
    )


def _run_demo(args: argparse.Namespace) -> int:
    from engine.demo_model.offline_demo import run_demo

    run_demo(args.max_tokens)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _run_generate(args)
        if args.command == "serve":
            return _run_serve(args)
        if args.command == "plan":
            return run_plan(args)
        if args.command == "profile":
            return run_profile(args)
        return _run_demo(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"pdserve: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())


def console_main() -> None:
    sys.exit(main())
