"""``pdserve serve``: start the cluster and its front doors, print where to reach them, run
until Ctrl-C / SIGTERM, then drain and stop.

Stopping, in order: the first SIGINT or SIGTERM -> new requests get 503 (Retry-After), /health
503 -> requests in flight run on for up to ``--drain-timeout-s`` (a second signal ends the wait)
-> those still running are ended, each client told why -> the servers stop -> the workers stop
-> the local Ray stops (a joined cluster is only left) -> the process exits.

With ``--prompt`` it generates for those prompts through the cluster and exits instead (a smoke
test for a fresh deployment, used by the KubeRay job).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import shlex
import socket
import time
from collections.abc import Callable

import ray

from engine.sampling.params import SamplingParams
from engine.startup_heap import freeze_startup_heap
from router.cluster import Cluster, RequestFailedError
from router.cluster_config import ClusterConfig
from router.detokenizer import IncrementalDetokenizer
from router.gateway.auth import ApiKeys
from router.gateway.first_token_log import FirstTokenLog
from router.gateway.limits import RequestLimits
from router.gateway.metrics import SloTargets
from router.gateway.responses_store import ResponseStore
from router.gateway.served_model import ServedModel
from router.gateway.server import GatewayServer, check_bind_address
from router.gateway.service import Gateway
from router.gateway.slo_admission import AdmissionPolicy
from router.gateway.tool_calls import TOOL_CALL_PARSERS
from router.gil_switch import hand_off_the_gil_sooner
from router.local_ray import stop_ray
from router.stop_signals import StopSignals, exit_if_stuck, interrupt_on_stop_signals

_DEFAULT_MAX_N = 16  # --max-n, when --max-num-seqs is at least this
# From the first stop signal, the process ends within the drain timeout plus this, however the
# stopping of the servers, the workers and Ray goes.
_STOP_LIMIT_S = 9.0


def run_serve(args: argparse.Namespace, config: ClusterConfig) -> int:
    """Runs ``pdserve serve`` until it is stopped; returns the exit status."""
    hand_off_the_gil_sooner()
    interrupt_on_stop_signals()  # until it serves: SIGTERM, as Ctrl-C, stops the start
    try:
        return _run_serve(args, config)
    except KeyboardInterrupt:
        print("pdserve: interrupted", flush=True)
        return 130


def _run_serve(args: argparse.Namespace, config: ClusterConfig) -> int:
    if args.drain_timeout_s < 0:
        raise ValueError(f"--drain-timeout-s must be >= 0, got {args.drain_timeout_s:g}")
    tool_call_parser = auto_tool_call_parser(args)
    keys = ApiKeys.from_sources(args.api_key or [], args.api_key_file)
    check_bind_address(args.host, keys.enabled, args.allow_unauthenticated)
    model = ServedModel.load(
        config.model_dir,
        args.served_model_name,
        config.max_model_len,
        int(time.time()),
        tool_call_parser=tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        dtype=config.dtype,
        device=config.device,
        kv_cache_dtype=config.kv_cache_dtype,
        trust_remote_code=config.trust_remote_code,
    )
    limits = request_limits(args, config, model.max_model_len)
    slo = SloTargets(ttft_s=args.slo_ttft_ms / 1000, tpot_s=args.slo_tpot_ms / 1000)
    admission = admission_policy(args)
    grpc_port = None if args.grpc_port < 0 else args.grpc_port
    trace_log = None
    if not args.prompt:  # before the workers load, which takes minutes on GPUs
        check_ports_free(args.host, args.http_port, grpc_port)
        trace_log = first_token_log(args.first_token_trace)
    ray_was_running = ray.is_initialized()
    try:
        cluster = Cluster.start(config)
        try:
            if args.prompt:
                print(
                    f"pdserve: cluster up ({_pools(config)} workers{_kv_transport(config)}"
                    f"{_speculation(config)})",
                    flush=True,
                )
                return _generate_once(
                    cluster, model, args.prompt, args.max_tokens, args.temperature
                )
            responses = ResponseStore(args.responses_store_size)
            gateway = Gateway(cluster, model, limits, keys, slo, trace_log, admission, responses)
            server = GatewayServer(gateway, args.host, args.http_port, grpc_port)
            banner = functools.partial(
                _banner, config, model, server, keys.enabled, args.drain_timeout_s
            )
            _serve_until_stopped(server, banner, args.drain_timeout_s)
        finally:
            cluster.shutdown()
    finally:
        if not ray_was_running:
            stop_ray()
    print("pdserve: stopped", flush=True)
    return 0


def _serve_until_stopped(
    server: GatewayServer, banner: Callable[[], str], drain_timeout_s: float
) -> None:
    """Serves until a stop signal, then drains; the servers are stopped on the way out.
    ``banner()`` is printed once the servers listen."""
    start_server(server)
    freeze_startup_heap()  # (the cluster, the model's tokenizer and the servers are built)
    try:
        signals = StopSignals()
        signals.install()
        print(banner(), flush=True)
        signals.wait_first()
        exit_if_stuck(drain_timeout_s + _STOP_LIMIT_S)
        _drain(server, drain_timeout_s, signals)
    finally:
        server.stop()


def _drain(server: GatewayServer, timeout_s: float, signals: StopSignals) -> None:
    """Lets the requests in flight end, for up to ``timeout_s`` or until a second signal."""
    num_in_flight = server.gateway.num_in_flight
    if num_in_flight:
        print(
            f"pdserve: stopping; draining {num_in_flight} requests in flight for up to "
            f"{timeout_s:g} s (Ctrl-C or SIGTERM again stops at once)",
            flush=True,
        )
    else:
        print("pdserve: stopping", flush=True)
    outcome = server.drain(timeout_s, signals.second)
    if outcome.num_cut_off:
        why = "told to stop at once" if outcome.cut_short else f"drain timeout of {timeout_s:g} s"
        print(
            f"pdserve: ended {outcome.num_cut_off} requests unfinished ({why})",
            flush=True,
        )


def first_token_log(path: str | None) -> FirstTokenLog | None:
    """The log ``--first-token-trace`` names, opened for appending (None: not asked for);
    ValueError naming the flag when it cannot be."""
    if path is None:
        return None
    try:
        return FirstTokenLog(path)
    except OSError as error:
        raise ValueError(f"--first-token-trace {path}: {error.strerror or error}") from None


def request_limits(
    args: argparse.Namespace, config: ClusterConfig, max_model_len: int
) -> RequestLimits:
    """The gateway's limits from the flags. A request's ``n`` samples run together on one
    worker, so ``--max-n`` is at most ``--max-num-seqs`` (the workers refused more); a
    ``priority`` is refused unless the workers schedule by it."""
    max_n = args.max_n if args.max_n is not None else min(_DEFAULT_MAX_N, config.max_num_seqs)
    if max_n > config.max_num_seqs:
        raise ValueError(
            f"--max-n {max_n} is above --max-num-seqs {config.max_num_seqs}: a request's "
            "samples run at once on one worker; lower --max-n or raise --max-num-seqs"
        )
    return RequestLimits(
        max_model_len=max_model_len,
        max_body_bytes=args.max_body_bytes,
        max_tokens=args.max_output_tokens,
        max_n=max_n,
        max_stop_strings=args.max_stop_strings,
        max_messages=args.max_messages,
        max_concurrent_requests=args.max_concurrent_requests,
        scheduling_policy=config.scheduling_policy,
    )


def admission_policy(args: argparse.Namespace) -> AdmissionPolicy:
    """The gateway's admission settings from the flags (a bad one names its flag)."""
    return AdmissionPolicy(
        args.admission,
        args.admission_margin,
        args.admission_fair_share_after,
        args.admission_attainment,
    )


def auto_tool_call_parser(args: argparse.Namespace) -> str | None:
    """The parser tool_choice "auto" reads calls with: ``--tool-call-parser`` where
    ``--enable-auto-tool-choice`` is set; None: "auto" is refused (a parser alone enables
    nothing, as in vLLM). The first flag without the second is an error, as vLLM's."""
    if not args.enable_auto_tool_choice:
        return None
    if args.tool_call_parser is None:
        raise ValueError(
            "--enable-auto-tool-choice requires --tool-call-parser (the format the model "
            f"writes tool calls in: {', '.join(TOOL_CALL_PARSERS)})"
        )
    parser: str = args.tool_call_parser
    return parser


def check_ports_free(host: str, http_port: int, grpc_port: int | None) -> None:
    """Refuse, naming its flag, a port that cannot be listened on (taken, or both servers
    on it), before the cluster starts. 0 (any free port) and None (no server) always pass."""
    if http_port and http_port == grpc_port:
        raise ValueError(f"--http-port and --grpc-port are both {http_port}")
    for flag, port in (("--http-port", http_port), ("--grpc-port", grpc_port)):
        if port:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do
                try:
                    sock.bind((host, port))
                except OSError as error:
                    raise ValueError(_cannot_listen(flag, host, port, error)) from None


def start_server(server: GatewayServer) -> None:
    """``server.start()``, a port taken since ``check_ports_free`` refused naming its flag:
    the HTTP server raises OSError, the gRPC one RuntimeError."""
    try:
        server.start()
    except TimeoutError:  # an OSError too, but no port's fault
        raise
    except (OSError, RuntimeError) as error:
        server.stop()
        port: int | None
        if isinstance(error, OSError):
            flag, port = "--http-port", server.http_port
        else:
            flag, port = "--grpc-port", server.grpc_port
        raise ValueError(_cannot_listen(flag, server.host, port, error)) from None


def _cannot_listen(flag: str, host: str, port: int | None, error: Exception) -> str:
    reason = error.strerror if isinstance(error, OSError) and error.strerror else error
    return f"{flag} {port}: cannot listen on {host}: {reason}"


def _banner(
    config: ClusterConfig,
    model: ServedModel,
    server: GatewayServer,
    auth: bool,
    drain_timeout_s: float,
) -> str:
    pools = _pools(config)
    body = json.dumps({"model": model.name, "prompt": "The os module", "max_tokens": 32})
    curl = f"curl {server.http_url}/v1/completions -H 'Content-Type: application/json'"
    if auth:
        curl += ' -H "Authorization: Bearer $PDSERVE_API_KEY"'
    lines = [
        f"pdserve: serving {model.name!r} with {pools} workers "
        f"(policy {config.router_policy}{_scheduling(config)}{_kv_transport(config)}"
        f"{_speculation(config)})",
        f"  OpenAI HTTP  {server.http_url}/v1   (health {server.http_url}/health)",
    ]
    if server.grpc_port is not None:
        lines.append(f"  gRPC         {server.grpc_target}   (service pdserve.v1.Generation)")
    lines += [
        f"  try:  {curl} -d {shlex.quote(body)}",
        "  Ctrl-C or SIGTERM stops the server (requests in flight first get up to "
        f"{drain_timeout_s:g} s).",
    ]
    return "\n".join(lines)


def _pools(config: ClusterConfig) -> str:
    decode = f"{config.num_decode}{_ranks(config.decode_tp, config.expert_parallel)}"
    if config.colocated:
        return f"{decode} colocated"
    prefill = f"{config.num_prefill}{_ranks(config.prefill_tp, config.expert_parallel)}"
    return f"{prefill} prefill + {decode} decode"


def _ranks(tensor_parallel_size: int, expert_parallel: bool) -> str:
    """`` x TP2``, and `` EP`` where the ranks hold whole experts (--enable-expert-parallel)."""
    if tensor_parallel_size == 1:
        return ""
    return f" x TP{tensor_parallel_size}{' EP' if expert_parallel else ''}"


def _scheduling(config: ClusterConfig) -> str:
    by_priority = ", scheduling by priority" if config.scheduling_policy == "priority" else ""
    return by_priority + (", async scheduling" if config.async_scheduling else "")


def _kv_transport(config: ClusterConfig) -> str:
    return "" if config.colocated else f", KV over {config.transport_in_words}"


def _speculation(config: ClusterConfig) -> str:
    spec = config.speculative
    if spec is None:
        return ""
    by = "" if spec.model is None else f" by {spec.model}"
    return f", {spec.method} speculation of up to {spec.num_speculative_tokens} tokens{by}"


def _generate_once(
    cluster: Cluster, model: ServedModel, prompts: list[str], max_tokens: int, temperature: float
) -> int:
    """Exit status 1 if any prompt failed (the KubeRay smoke test's verdict), else 0."""
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
    num_failed = 0
    for prompt in prompts:
        num_failed += not asyncio.run(_complete(cluster, model.tokenizer, prompt, params))
    return 1 if num_failed else 0


async def _complete(
    cluster: Cluster, tokenizer: object, prompt: str, params: SamplingParams
) -> bool:
    """Print a completion of ``prompt``; False if the cluster failed it."""
    detokenizer = IncrementalDetokenizer(tokenizer)  # type: ignore[arg-type]
    num_tokens = 0
    print(prompt, end="", flush=True)
    try:
        async for event in cluster.generate(tokenizer.encode(prompt), params):  # type: ignore[attr-defined]
            num_tokens += 1
            print(detokenizer.push(event.token_id), end="", flush=True)
    except RequestFailedError as error:
        print(f"\n[failed: {error}]", flush=True)
        return False
    print(detokenizer.flush(), end="")
    print(f"\n[{num_tokens} tokens]", flush=True)
    return True
