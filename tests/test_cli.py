"""The pdserve command line."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import httpx
import pytest
import torch

from engine.demo_model import DEMO_MODEL_DIR
from engine.messages import TokenEvent
from engine.sampling.params import SamplingParams
from engine.speculative.config import SpeculativeConfig
from kv_transfer.policy import describe_auto
from router.cli import build_parser, main, rebalance_config
from router.cluster import RequestFailedError, SlotRestarts, WorkerStatus
from router.cluster_config import ClusterConfig
from router.gateway.auth import ApiKeys
from router.gateway.limits import RequestLimits
from router.gateway.served_model import ServedModel
from router.gateway.server import GatewayServer
from router.gateway.service import Gateway
from router.latency_model import StepRatios
from router.serve_command import (
    _generate_once,
    admission_policy,
    auto_tool_call_parser,
    check_ports_free,
    request_limits,
    start_server,
)
from router.serve_defaults import MIN_CORES_TO_DISAGGREGATE


def _pdserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "router.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_prints_a_completion(llama_dir: Path) -> None:
    result = _pdserve(
        "generate",
        "--model",
        str(llama_dir),
        "--prompt",
        "def main():",
        "--max-tokens",
        "5",
        "--dtype",
        "float32",
        "--device",
        "cpu",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def main():")
    assert "5 tokens]" in result.stdout or "[stop;" in result.stdout


def test_generate_over_two_ranks_prints_what_one_rank_does(llama_dir: Path) -> None:
    flags = ["--prompt", "def main():", "--max-tokens", "8", "--dtype", "float32"]
    one = _pdserve("generate", "--model", str(llama_dir), *flags, "--device", "cpu")
    two = _pdserve("generate", "--model", str(llama_dir), *flags, "--device", "cpu", "-tp", "2")
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert two.stdout == one.stdout
    bad = _pdserve("generate", "--model", str(llama_dir), *flags, "--device", "cpu", "-tp", "3")
    assert bad.returncode == 2
    assert "tensor_parallel_size 3 must divide num_attention_heads 4" in bad.stderr


def test_generate_reports_bad_input_by_field(llama_dir: Path) -> None:
    result = _pdserve(
        "generate", "--model", str(llama_dir), "--prompt", "x", "--top-p", "2", "--device", "cpu"
    )
    assert result.returncode == 2
    assert "top_p" in result.stderr


def test_unknown_architecture_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    result = _pdserve("generate", "--model", str(tmp_path), "--prompt", "x", "--device", "cpu")
    assert result.returncode == 2
    assert "LlamaForCausalLM" in result.stderr


def test_demo_runs() -> None:
    result = _pdserve("demo", "--max-tokens", "4")
    assert result.returncode == 0, result.stderr
    assert "tokens/s" in result.stdout


def test_serve_starts_a_cluster_and_streams_completions(llama_dir: Path) -> None:
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "router.cli",
            "serve",
            "--model",
            str(llama_dir),
            "--prefill",
            "1",
            "--decode",
            "1",
            "--worker-num-cpus",
            "0",
            "--dtype",
            "float32",
            "--block-size",
            "8",
            "--num-kv-blocks",
            "200",
            "--max-tokens",
            "6",
            "--prompt",
            "def main():",
            "--prompt",
            "import os",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "cluster up (1 prefill + 1 decode workers, KV over shm within a host, gloo between hosts)"
        in result.stdout
    )
    assert result.stdout.count(" tokens]") == 2  # one summary line per prompt
    assert "def main():" in result.stdout and "import os" in result.stdout


def _serve_process(model_dir: Path | None, *extra: str) -> subprocess.Popen[str]:
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled")
    model = ["--model", str(model_dir)] if model_dir is not None else []
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "router.cli",
            "serve",
            *model,
            "--worker-num-cpus",
            "0",
            "--block-size",
            "8",
            "--num-kv-blocks",
            "200",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


@contextlib.contextmanager
def _serving(model_dir: Path | None, *extra: str) -> Iterator[tuple[str, str, int]]:
    """A running `pdserve serve`: (its banner, its OpenAI base URL, its pid); Ctrl-C must stop
    it."""
    process = _serve_process(model_dir, *extra)
    try:
        assert process.stdout is not None
        banner = []
        for line in process.stdout:
            banner.append(line)
            if "Ctrl-C" in line:
                break
        text = "".join(banner)
        url = next((line.split()[2] for line in banner if "OpenAI HTTP" in line), None)
        assert url is not None, text
        yield text, url, process.pid
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()


def _processes_under(serve_pid: int) -> dict[str, list[int]]:
    """The processes started (at any depth) by ``serve_pid``, by their process title."""
    parents: dict[int, int] = {}
    titles: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
            pid = int(entry.name)
            parents[pid] = int(fields[1])
            titles[pid] = (entry / "cmdline").read_bytes().split(b"\0")[0].decode()

    def descends(pid: int) -> bool:
        while pid > 1:
            if pid == serve_pid:
                return True
            pid = parents.get(pid, 1)
        return False

    found: dict[str, list[int]] = {}
    for pid, title in titles.items():
        if pid != serve_pid and descends(pid):
            found.setdefault(title, []).append(pid)
    return found


def _worker_niceness(serve_pid: int) -> dict[str, list[int]]:
    """Niceness of each Ray worker actor process under ``serve_pid``, by their process title."""
    return {
        title: [os.getpriority(os.PRIO_PROCESS, pid) for pid in pids]
        for title, pids in _processes_under(serve_pid).items()
        if title.startswith("ray::") and title.endswith("Actor")
    }


def test_serve_prints_its_urls_answers_http_and_stops_on_ctrl_c(chat_model_dir: Path) -> None:
    extra = ("--http-port", "0", "--grpc-port", "0", "--served-model-name", "tiny")
    extra += ("--prefill", "1", "--decode", "1")
    with _serving(chat_model_dir, *extra, "--dtype", "float32") as (text, url, pid):
        assert (
            "1 prefill + 1 decode workers (policy kv_aware, KV over shm within a host, gloo between hosts)"
            in text
        ), text
        assert "gRPC         127.0.0.1:" in text and "curl http://127.0.0.1:" in text
        body = {"model": "tiny", "prompt": "def main():", "max_tokens": 4}
        response = httpx.post(url + "/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
        # Ray would start them at niceness 15, behind the gateway on a shared CPU.
        assert _worker_niceness(pid) == {"ray::WorkerActor": [0, 0]}  # a prefill, a decode


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a core beside the worker's")
def test_serve_binds_its_worker_to_a_core_of_its_own(chat_model_dir: Path) -> None:
    """--bind-worker-cpus: the engine on the first core, the gateway and Ray on the others."""
    cpus = sorted(os.sched_getaffinity(0))
    extra = ("--prefill", "0", "--decode", "1", "--http-port", "0", "--grpc-port", "-1")
    extra += ("--served-model-name", "tiny", "--dtype", "float32", "--bind-worker-cpus")
    with _serving(chat_model_dir, *extra) as (_, url, pid):
        body = {"model": "tiny", "prompt": "a", "max_tokens": 3}
        response = httpx.post(url + "/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        processes = _processes_under(pid)
        (worker,) = processes["ray::WorkerActor"]
        # the actor's own (main) thread runs the engine and starts its threads
        assert os.sched_getaffinity(worker) == {cpus[0]}
        assert os.sched_getaffinity(pid) == set(cpus[1:])
        raylet = next(pids[0] for title, pids in processes.items() if "raylet" in title)
        assert os.sched_getaffinity(raylet) == set(cpus[1:])


def test_serve_refuses_to_bind_more_cores_than_it_has(llama_dir: Path) -> None:
    too_many = str(len(os.sched_getaffinity(0)))
    process = _serve_process(
        llama_dir, "--prefill", "0", "--decode", too_many, "--bind-worker-cpus", "--http-port", "0"
    )
    output, _ = process.communicate(timeout=120)
    assert process.returncode != 0
    assert "--bind-worker-cpus needs" in output and "plus 1 for the gateway" in output, output


def test_serve_refuses_a_negative_prefill_queue_limit_naming_the_flag(llama_dir: Path) -> None:
    process = _serve_process(llama_dir, "--max-prefill-queue-tokens", "-1", "--http-port", "0")
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 2
    assert "--max-prefill-queue-tokens must be >= 0, got -1" in output, output


def test_serve_refuses_a_cpu_kv_transport_for_gpu_caches_naming_the_flag(llama_dir: Path) -> None:
    process = _serve_process(
        llama_dir, "--device", "cuda", "--kv-transport", "gloo", "--http-port", "0"
    )
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 2
    assert "--kv-transport gloo cannot move cuda KV caches" in output, output


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="two GPUs hold the default pools")
def test_serve_on_too_few_gpus_says_so_instead_of_waiting(llama_dir: Path) -> None:
    """Ray would keep the second worker of one GPU pending for ever."""
    process = _serve_process(llama_dir, "--device", "cuda", "--http-port", "0")
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 2, output
    assert "2 workers of --worker-num-gpus 1 need 2 GPUs" in output, output


def test_serve_with_a_resource_this_ray_lacks_says_so_instead_of_waiting(llama_dir: Path) -> None:
    """A local Ray declares no custom resources: the workers would stay pending for ever."""
    process = _serve_process(
        llama_dir, "--device", "cpu", "--decode-resource", "decode_node", "--http-port", "0"
    )
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 2, output
    assert "--decode-resource decode_node: the workers need 1 of Ray resource" in output, output


def test_serve_with_more_worker_cpus_than_this_ray_has_says_so_instead_of_waiting(
    llama_dir: Path,
) -> None:
    """Ray would start the workers that fit and keep the rest pending for ever (`--prefill 2
    --decode 2` on a 2-core machine waited silently)."""
    num_decode = (os.cpu_count() or 1) + 1
    flags = ("--prefill", "0", "--decode", str(num_decode), "--worker-num-cpus", "1")
    process = _serve_process(llama_dir, *flags, "--http-port", "0", "--grpc-port", "-1")
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 2, output
    assert f"{num_decode} workers of --worker-num-cpus 1 need {num_decode} CPUs" in output, output


def test_serve_refuses_a_public_address_without_api_keys(chat_model_dir: Path) -> None:
    process = _serve_process(chat_model_dir, "--host", "0.0.0.0", "--http-port", "0")
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 2
    assert "--allow-unauthenticated" in output and "refusing to listen on 0.0.0.0" in output


def test_serve_without_a_model_serves_the_bundled_demo() -> None:
    """What `make serve` runs: the trained demo model answers in words."""
    with _serving(None, "--http-port", "0", "--grpc-port", "-1") as (text, url, _):
        assert "serving 'pdserve-demo'" in text, text
        if len(os.sched_getaffinity(0)) < MIN_CORES_TO_DISAGGREGATE:  # CI's 2 cores
            assert "pdserve: one colocated worker (" in text, text
            assert "with 1 colocated workers" in text, text
        else:
            assert "with 1 prefill + 1 decode workers" in text, text
        body = {"model": "pdserve-demo", "prompt": "Return the", "max_tokens": 24, "temperature": 0}
        response = httpx.post(url + "/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        words = re.findall(r"[a-z]+", response.json()["choices"][0]["text"].lower())
        assert {"the", "is", "of", "a"} & set(words), words


# ---- serve's flags, refused before the cluster starts (no Ray in these) ----------------------


def _serve_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *flags])


def test_the_admission_flags_reach_the_gateways_policy() -> None:
    policy = admission_policy(
        _serve_args(
            "--admission", "slo", "--admission-margin", "0", "--admission-attainment", "0.99"
        )
    )
    assert (policy.mode, policy.margin, policy.attainment) == ("slo", 0.0, 0.99)
    default = admission_policy(_serve_args())
    assert (default.margin, default.attainment) == (0.0, 0.95)
    with pytest.raises(ValueError, match=r"--admission-attainment must be in \[0.5, 1\)"):
        admission_policy(_serve_args("--admission", "slo", "--admission-attainment", "1"))


def test_the_rebalance_flags_reach_the_policys_config() -> None:
    slos = ("--slo-ttft-ms", "500", "--slo-tpot-ms", "50")
    config = rebalance_config(_serve_args("--rebalance", *slos, "--rebalance-max-moves", "2"))
    assert config is not None and (config.slo_ttft_s, config.slo_tpot_s) == (0.5, 0.05)
    assert config.max_moves == 2
    default = rebalance_config(_serve_args("--rebalance", *slos))
    assert default is not None and default.max_moves is None  # as many as the shift needs
    assert rebalance_config(_serve_args(*slos)) is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--http-port", "70000"), "argument --http-port: must be in 0..65535, got 70000"),
        (("--grpc-port", "70000"), "argument --grpc-port: must be in -1..65535, got 70000"),
        (("--grpc-port", "-2"), "argument --grpc-port: must be in -1..65535, got -2"),
        (("--max-body-bytes", str(1 << 30)), f"must be in 1..{512 << 20}, got {1 << 30}"),
        (("--max-output-tokens", "0"), "argument --max-output-tokens: must be >= 1, got 0"),
        (("--max-n", "0"), "argument --max-n: must be >= 1, got 0"),
        (("--max-tokens", "0"), "argument --max-tokens: must be >= 1, got 0"),
        (("--max-concurrent-requests", "0"), "argument --max-concurrent-requests: must be >= 1"),
        (("--max-worker-restarts", "-1"), "argument --max-worker-restarts: must be >= 0, got -1"),
        (("--rebalance-max-moves", "0"), "argument --rebalance-max-moves: must be >= 1, got 0"),
    ],
)
def test_serve_refuses_flags_out_of_range_naming_the_flag(
    flags: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, --http-port 70000 started the cluster and then died with an OverflowError,
    --grpc-port 70000 served on 4464, and --max-body-bytes 1 GiB overflowed a gRPC option."""
    with pytest.raises(SystemExit) as exit_:
        _serve_args(*flags)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_serve_accepts_the_ends_of_the_ranges() -> None:
    args = _serve_args("--http-port", "65535", "--grpc-port", "-1", "--max-body-bytes", "1")
    assert (args.http_port, args.grpc_port, args.max_body_bytes) == (65535, -1, 1)


def test_auto_tool_choice_takes_the_parser_named_with_it() -> None:
    for parser in ("hermes", "llama3_json", "llama4_json", "mistral"):
        flags = ("--enable-auto-tool-choice", "--tool-call-parser", parser)
        assert auto_tool_call_parser(_serve_args(*flags)) == parser
    assert auto_tool_call_parser(_serve_args()) is None  # "auto" refused, as by default
    # a parser alone enables nothing, as in vLLM
    assert auto_tool_call_parser(_serve_args("--tool-call-parser", "hermes")) is None


def test_auto_tool_choice_without_a_parser_is_refused_at_start_naming_both_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before the model, the workers or the servers start (as vLLM refuses it)."""
    assert main(["serve", "--enable-auto-tool-choice"]) == 2
    error = capsys.readouterr().err
    assert "--enable-auto-tool-choice requires --tool-call-parser" in error, error
    assert "hermes" in error


def test_an_unknown_tool_call_parser_is_refused_listing_the_supported_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        _serve_args("--enable-auto-tool-choice", "--tool-call-parser", "granite")
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert "argument --tool-call-parser: invalid choice: 'granite'" in error, error
    for parser in ("hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic"):
        assert parser in error.split("invalid choice")[1]


def test_responses_are_kept_only_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    assert _serve_args().responses_store_size == 0  # vLLM's default: none kept
    assert _serve_args("--responses-store-size", "100").responses_store_size == 100
    with pytest.raises(SystemExit):
        _serve_args("--responses-store-size", "-1")
    assert "--responses-store-size" in capsys.readouterr().err


def test_reasoning_parser_is_one_of_vllms_and_off_by_default() -> None:
    assert _serve_args().reasoning_parser is None  # chat output is not split
    for name in ("deepseek_r1", "qwen3"):
        assert _serve_args("--reasoning-parser", name).reasoning_parser == name


def test_an_unknown_reasoning_parser_is_refused_listing_the_supported_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        _serve_args("--reasoning-parser", "granite")
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert "argument --reasoning-parser: invalid choice: 'granite'" in error, error
    choices = error.split("invalid choice")[1]
    assert "deepseek_r1" in choices and "qwen3" in choices


def test_the_reasoning_parser_reaches_the_served_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stored on the ServedModel as the tool-call parser is; loading stops the command here."""
    loaded: list[dict[str, object]] = []

    def load(*args: object, **kwargs: object) -> ServedModel:
        loaded.append(kwargs)
        raise ValueError("stop before the cluster starts")

    monkeypatch.setattr(ServedModel, "load", load)
    assert main(["serve", "--reasoning-parser", "qwen3"]) == 2
    assert main(["serve"]) == 2
    assert [kwargs["reasoning_parser"] for kwargs in loaded] == ["qwen3", None]
    assert "stop before the cluster starts" in capsys.readouterr().err


def _limits(*flags: str) -> RequestLimits:
    args = _serve_args(*flags)
    config = ClusterConfig("model", max_num_seqs=args.max_num_seqs)
    return request_limits(args, config, max_model_len=64)


def test_max_n_defaults_to_16_or_max_num_seqs_if_fewer() -> None:
    assert _limits().max_n == 16
    assert _limits("--max-num-seqs", "4").max_n == 4  # before: 16, and n=8 failed on a worker
    assert _limits("--max-num-seqs", "4", "--max-n", "4").max_n == 4


def test_max_n_above_max_num_seqs_is_refused_naming_both_flags() -> None:
    with pytest.raises(ValueError, match="--max-n 8 is above --max-num-seqs 4"):
        _limits("--max-num-seqs", "4", "--max-n", "8")


@contextlib.contextmanager
def _listening() -> Iterator[int]:
    """A port another socket listens on."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield busy.getsockname()[1]


@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port"])
def test_a_taken_port_is_refused_before_the_cluster_starts(flag: str) -> None:
    with _listening() as port:
        ports = (port, None) if flag == "--http-port" else (0, port)
        with pytest.raises(ValueError, match=f"^{flag} {port}: cannot listen on 127.0.0.1: "):
            check_ports_free("127.0.0.1", *ports)
    check_ports_free("127.0.0.1", 0, 0)  # any free port
    with pytest.raises(ValueError, match="--http-port and --grpc-port are both 8123"):
        check_ports_free("127.0.0.1", 8123, 8123)


class _IdleCluster:
    """A backend with no workers: enough for the servers to start."""

    def worker_statuses(self) -> list[WorkerStatus]:
        return []

    def local_prefills(self) -> dict[str, int]:
        return {}

    def worker_restarts(self) -> list[SlotRestarts]:
        return []

    def prefix_hit_stats(self) -> None:
        return None

    def role_switches(self) -> dict[tuple[str, str], int]:
        return {}

    def step_prediction_ratios(self) -> dict[str, StepRatios]:
        return {}


@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port"])
def test_a_port_taken_after_the_check_is_one_error_naming_the_flag(
    flag: str, llama_dir: Path
) -> None:
    """The HTTP server raised OSError and the gRPC one RuntimeError, which cli.main did not
    catch: a traceback after the workers had loaded."""
    model = ServedModel.load(str(llama_dir), "tiny", None)
    limits = RequestLimits(max_model_len=model.max_model_len)
    gateway = Gateway(_IdleCluster(), model, limits, ApiKeys([]))  # type: ignore[arg-type]
    with _listening() as port:
        ports = (port, None) if flag == "--http-port" else (0, port)
        server = GatewayServer(gateway, "127.0.0.1", *ports)
        with pytest.raises(ValueError, match=f"^{flag} {port}: cannot listen on 127.0.0.1"):
            start_server(server)


def test_kv_transport_help_states_the_rule_auto_follows(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        _serve_args("--help")
    help_text = " ".join(capsys.readouterr().out.split())  # unwrapped
    assert f"on cpu {describe_auto('cpu')}; on cuda {describe_auto('cuda')}" in help_text


class _FailingCluster:
    """A cluster whose workers fail every request after its first token."""

    async def generate(
        self, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        yield TokenEvent("r", 0, 0, 1, None, None, 0, 0.0)
        raise RequestFailedError("decode worker decode-0 died")


def test_one_shot_serve_exits_non_zero_when_a_prompt_fails(
    llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The KubeRay smoke test (deploy/kuberay/pdserve-rayjob.yaml) reads this exit status."""
    model = ServedModel.load(str(llama_dir), "tiny", None)
    status = _generate_once(_FailingCluster(), model, ["a", "b"], 4, 0.0)  # type: ignore[arg-type]
    assert status == 1
    assert capsys.readouterr().out.count("[failed: decode worker decode-0 died]") == 2


def _served_configs(monkeypatch: pytest.MonkeyPatch, *flag_lists: list[str]) -> list[ClusterConfig]:
    """The ClusterConfig each ``pdserve serve <flags>`` would launch (the launch replaced), one
    per flag list; each command must exit 0."""
    configs: list[ClusterConfig] = []

    def run_serve(args: object, config: ClusterConfig) -> int:
        configs.append(config)
        return 0

    monkeypatch.setattr("router.serve_command.run_serve", run_serve)
    for flags in flag_lists:
        assert main(["serve", *flags]) == 0
    return configs


def test_kv_transfer_checksum_reaches_the_workers_transfer_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    configs = _served_configs(monkeypatch, ["--kv-transfer-checksum"], [])
    assert [c.transfer_config().checksum for c in configs] == [True, False]


def test_trust_remote_code_reaches_the_workers_load_config(monkeypatch: pytest.MonkeyPatch) -> None:
    configs = _served_configs(monkeypatch, ["--trust-remote-code"], [])
    assert [c.load_config().trust_remote_code for c in configs] == [True, False]


def test_max_worker_restarts_reaches_the_cluster_config(monkeypatch: pytest.MonkeyPatch) -> None:
    configs = _served_configs(monkeypatch, ["--max-worker-restarts", "0"], [])
    assert [c.max_worker_restarts for c in configs] == [0, 10]


def test_the_scheduling_policy_reaches_every_workers_scheduler_and_the_gateway(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--scheduling-policy reaches the ClusterConfig, both pools' SchedulerConfigs, and the
    gateway's limits (which refuse a priority under fcfs)."""
    configs: list[ClusterConfig] = []
    limits: list[RequestLimits] = []

    def run_serve(args: argparse.Namespace, config: ClusterConfig) -> int:
        configs.append(config)
        limits.append(request_limits(args, config, max_model_len=64))
        return 0

    monkeypatch.setattr("router.serve_command.run_serve", run_serve)
    assert main(["serve", "--scheduling-policy", "priority"]) == 0
    assert main(["serve", "--prefill", "0", "--scheduling-policy", "priority"]) == 0
    assert main(["serve", "--scheduling-policy", "fcfs"]) == 0
    assert main(["serve"]) == 0
    assert [c.scheduling_policy for c in configs] == ["priority", "priority", "fcfs", "fcfs"]
    assert [c.scheduler_config().policy for c in configs] == [c.scheduling_policy for c in configs]
    assert [c.prefill_scheduler_config().policy for c in configs] == [
        c.scheduling_policy for c in configs
    ]
    assert [lim.scheduling_policy for lim in limits] == ["priority", "priority", "fcfs", "fcfs"]


def test_an_unknown_scheduling_policy_is_refused_listing_vllms(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        _serve_args("--scheduling-policy", "lifo")
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert "argument --scheduling-policy: invalid choice: 'lifo'" in error, error
    assert "'fcfs'" in error and "'priority'" in error


def test_async_scheduling_reaches_every_workers_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    configs = _served_configs(
        monkeypatch, ["--async-scheduling"], ["--prefill", "0", "--async-scheduling"], []
    )
    assert [c.async_scheduling for c in configs] == [True, True, False]  # off by default
    assert [c.scheduler_config().async_scheduling for c in configs] == [True, True, False]
    assert [c.prefill_scheduler_config().async_scheduling for c in configs] == [True, True, False]


def test_async_scheduling_with_a_speculative_config_is_refused_at_start_naming_both_flags(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before the model, the workers or the servers start (each worker's engine refused it)."""
    monkeypatch.setattr("router.serve_command.run_serve", lambda *_: pytest.fail("started"))
    spec = '{"num_speculative_tokens": 2}'
    assert main(["serve", "--async-scheduling", "--speculative-config", spec]) == 2
    error = capsys.readouterr().err
    assert "--async-scheduling does not combine with --speculative-config" in error, error


# ---- --speculative-config: vLLM's JSON, checked before anything starts -----------------------

_NGRAM_4 = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"num_speculative_tokens": 4', "not valid JSON (Expecting ',' delimiter"),
        ("4", "must be a JSON object such as"),
        ('{"num_speculative_tokens": 4, "draft": "x"}', "unknown key(s) draft; accepted: method"),
        ('{"prompt_lookup_max": 4}', "speculative_config.num_speculative_tokens is required"),
        (
            '{"num_speculative_tokens": 0}',
            "speculative_config.num_speculative_tokens must be in [1, 16], got 0",
        ),
        (
            '{"num_speculative_tokens": 17}',
            "speculative_config.num_speculative_tokens must be in [1, 16], got 17",
        ),
        ('{"num_speculative_tokens": "4"}', "num_speculative_tokens must be an int, got str"),
        (
            '{"method": "eagle", "num_speculative_tokens": 4}',
            "speculative_config.method must be one of ngram, draft_model, mtp, got 'eagle'",
        ),
        (
            '{"num_speculative_tokens": 4, "prompt_lookup_min": 3, "prompt_lookup_max": 2}',
            "prompt_lookup_max (2) must be >= prompt_lookup_min (3)",
        ),
    ],
)
def test_a_bad_speculative_config_is_refused_naming_the_flag_and_the_field(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before the model, Ray or the servers start (exit status 2, as argparse's errors)."""
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--speculative-config", value])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert "argument --speculative-config: " in error and message in error, error


def test_the_speculative_config_reaches_the_cluster_config(monkeypatch: pytest.MonkeyPatch) -> None:
    colocated = ["--prefill", "0", "--decode", "2"]
    configs = _served_configs(
        monkeypatch,
        ["--speculative-config", _NGRAM_4],
        [*colocated, "--speculative-config", '{"num_speculative_tokens": 2}'],
        [],
    )
    assert [c.speculative for c in configs] == [
        SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=4),
        SpeculativeConfig(num_speculative_tokens=2),  # vLLM's lookup window: 5 both ways
        None,  # off by default
    ]


def test_a_draft_model_reaches_the_cluster_config_and_one_it_cannot_run_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The draft model's config is read before anything starts: a directory without one, or
    a draft shorter than the context served, exit 2 naming the field."""
    draft = f'{{"model": "{DEMO_MODEL_DIR}", "num_speculative_tokens": 3}}'
    (config,) = _served_configs(monkeypatch, ["--speculative-config", draft])
    assert config.speculative == SpeculativeConfig(
        3, method="draft_model", model=str(DEMO_MODEL_DIR)
    )
    missing = f'{{"model": "{tmp_path}", "num_speculative_tokens": 3}}'
    assert main(["serve", "--speculative-config", missing]) == 2
    error = capsys.readouterr().err
    assert f"speculative_config.model: {tmp_path}/config.json not found" in error, error
    assert main(["serve", "--max-model-len", "1024", "--speculative-config", draft]) == 2
    error = capsys.readouterr().err
    assert "max_position_embeddings (512) must be >= the target's max_model_len (1024)" in error


def test_generate_takes_the_same_speculative_config() -> None:
    flags = ["generate", "--model", "m", "--prompt", "x"]
    args = build_parser().parse_args([*flags, "--speculative-config", _NGRAM_4])
    assert args.speculative_config == SpeculativeConfig(4, 4, 4)
    assert build_parser().parse_args(flags).speculative_config is None


def test_serve_without_a_layout_runs_the_one_this_machine_suits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a 2-core CPU machine (CI's), one colocated worker on one core; on 4, 1P1D; named
    pools run as named."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    small = _served_configs(monkeypatch, [], ["--prefill", "1", "--decode", "1"])
    assert [(c.num_prefill, c.num_decode, c.bind_worker_cpus) for c in small] == [
        (0, 1, True),
        (1, 1, False),
    ]
    assert small[0].worker_num_cpus == 1
    assert [c.max_num_batched_tokens for c in small] == [512, 512]  # cpu's step budget
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    large = _served_configs(monkeypatch, [])
    assert [(c.num_prefill, c.num_decode, c.bind_worker_cpus) for c in large] == [(1, 1, False)]
