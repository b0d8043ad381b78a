"""Shared pieces of the deploy/ tests: reading the manifests, the pdserve argv inside them,
whether a pool's tensor-parallel workers fit its nodes, and running the manifests' shell
snippets with stand-in `ray` and `pdserve` commands."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import subprocess
import sys
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.model_config import ModelConfig, parse_model_config
from engine.parallel.shard import check_tensor_parallel_size, kv_heads_of_ranks
from router.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
NODE_TYPES = {"prefill": "prefill_gpu", "decode": "decode_gpu"}  # pdserve role -> node type
OTHER_ROLE = {"prefill": "decode", "decode": "prefill"}
REMOTE_SOURCE = "/home/ubuntu/pdserve"  # where cluster.yaml puts the source on every node
KEY_FILE = "/home/ubuntu/pdserve-api-keys"  # the gateway's keys on the `ray up` head
SHELL_TIMEOUT_S = 30

# The served models' config.json (the fields pdserve reads), as on the Hugging Face Hub: the
# tests run offline. A deployment of another model adds its entry here.
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-72B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 8192,
        "intermediate_size": 29568,
        "num_attention_heads": 64,
        "num_hidden_layers": 80,
        "num_key_value_heads": 8,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
}
# GPUs per node and one GPU's memory in bytes (nvidia-smi's total) of the node types deployed.
NODE_GPUS: dict[str, tuple[int, int]] = {
    "p5.48xlarge": (8, 81559 * 2**20),  # 8x NVIDIA H100 80 GB HBM3
}
BYTES_PER_PARAM = 2  # bf16, the checkpoint's dtype (--dtype auto)

# Stand-ins on PATH when a manifest's shell snippet runs: `ray start` records its argv (one
# argument per line, in $LOG/ray-start), `ray health-check` succeeds once `ray start` has run,
# and `pdserve` records its argv NUL-separated in $LOG/pdserve.
_FAKE_RAY = """#!/bin/sh
case "$1" in
  start) shift; printf '%s\\n' "$@" > "$LOG/ray-start.tmp" && mv "$LOG/ray-start.tmp" "$LOG/ray-start" ;;
  health-check) for _ in $(seq 50); do test -e "$LOG/ray-start" && exit 0; sleep 0.1; done; exit 1 ;;
  *) exit 2 ;;
esac
"""
_FAKE_PDSERVE = """#!/bin/sh
printf '%s\\0' pdserve "$@" > "$LOG/pdserve"
"""


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def pyproject() -> str:
    return (ROOT / "pyproject.toml").read_text()


def pinned_ray() -> str:
    match = re.search(r'"ray==([0-9.]+)"', pyproject())
    assert match, "pyproject.toml pins ray"
    return match.group(1)


def packages() -> list[str]:
    """Top-level packages that pyproject.toml's [tool.setuptools.packages.find] includes."""
    match = re.search(r"^include = \[(.*?)\]", pyproject(), re.MULTILINE | re.DOTALL)
    assert match, "pyproject.toml lists the packages to install"
    names = [name.strip(' "*\n') for name in match.group(1).split(",")]
    return [name for name in names if name]


def serve_argv(command: str) -> list[str]:
    """The ``pdserve serve ...`` argv inside a shell command (continuation lines joined)."""
    text = command.replace("\\\n", " ")
    line = next(line for line in text.splitlines() if "pdserve serve" in line)
    argv = shlex.split(line[line.index("pdserve serve") :])
    return [arg for arg in argv if arg != "$@"]  # the start script passes its arguments on


def parse_serve(argv: list[str]) -> Namespace:
    assert argv[:2] == ["pdserve", "serve"]
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"pdserve's CLI rejects the deploy command (see stderr): {shlex.join(argv)}")


def tensor_parallel_sizes(args: Namespace) -> dict[str, int]:
    """Each pool's ranks per worker, as `pdserve serve` reads -tp, --prefill-tp, --decode-tp."""
    return {
        "prefill": args.tensor_parallel_size if args.prefill_tp is None else args.prefill_tp,
        "decode": args.tensor_parallel_size if args.decode_tp is None else args.decode_tp,
    }


def served_model(args: Namespace) -> ModelConfig:
    name = args.served_model_name
    assert name in MODEL_CONFIGS, f"add {name}'s config.json to MODEL_CONFIGS (manifests.py)"
    return parse_model_config(MODEL_CONFIGS[name])


@dataclass(frozen=True, slots=True)
class PoolNodes:
    """The nodes (Ray nodes: `ray up` node types or KubeRay pods) one pool's workers run on."""

    role: str  # "prefill" | "decode"
    node_type: str  # instance type, a key of NODE_GPUS
    num_gpus: int  # GPUs per node
    num_units: int  # units of the pool's custom resource per node
    num_cpus: float  # Ray CPUs per node
    max_nodes: int  # the most nodes the pool may have


def workers_per_node(nodes: PoolNodes, tp: int, gpus_per_rank: float) -> int:
    """Workers of ``tp`` ranks one node holds: a worker's ranks never span nodes."""
    num_ranks = nodes.num_units  # one unit of the pool's resource per rank
    if gpus_per_rank > 0:
        num_ranks = min(num_ranks, int(nodes.num_gpus // gpus_per_rank))
    return num_ranks // tp


def cluster_pool_nodes(cluster: dict[str, Any], role: str) -> PoolNodes:
    """A `ray up` node type's nodes, as the pool of ``role`` sees them."""
    node = cluster["available_node_types"][NODE_TYPES[role]]
    resources = node["resources"]
    return PoolNodes(
        role=role,
        node_type=node["node_config"]["InstanceType"],
        num_gpus=int(resources["GPU"]),
        num_units=int(resources[role]),
        num_cpus=float(resources["CPU"]),
        max_nodes=int(node["max_workers"]),
    )


def kuberay_pool_nodes(group: dict[str, Any]) -> PoolNodes:
    """A KubeRay worker group's pods (one Ray node each), as the pool of its name sees them:
    KubeRay gives each pod's Ray the GPUs and CPUs of its container's limits."""
    role = group["groupName"]
    pod = group["template"]["spec"]
    limits = pod["containers"][0]["resources"]["limits"]
    units = json.loads(json.loads(group["rayStartParams"]["resources"]))
    return PoolNodes(
        role=role,
        node_type=pod["nodeSelector"]["node.kubernetes.io/instance-type"],
        num_gpus=int(limits["nvidia.com/gpu"]),
        num_units=int(units[role]),
        num_cpus=float(limits["cpu"]),
        max_nodes=int(group["maxReplicas"]),
    )


def rank_memory_bytes(model: ModelConfig, tp: int, num_tokens: int) -> int:
    """What one rank of ``tp`` holds: its 1/tp of the weights (biases and norms left out) and
    its KV heads of ``num_tokens`` tokens."""
    q_width = model.num_heads * model.head_dim
    kv_width = model.num_kv_heads * model.head_dim
    hidden = model.hidden_size
    layer = (
        hidden * (q_width + 2 * kv_width) + q_width * hidden + 3 * hidden * model.intermediate_size
    )
    embeddings = model.vocab_size * hidden * (1 if model.tie_word_embeddings else 2)
    weights = (embeddings + model.num_layers * layer) * BYTES_PER_PARAM // tp
    rank_kv_heads = len(kv_heads_of_ranks(model, tp)[0])
    kv_per_token = model.num_layers * rank_kv_heads * model.head_dim * 2 * BYTES_PER_PARAM  # K, V
    return weights + num_tokens * kv_per_token


def pool_problems(
    args: Namespace, nodes: PoolNodes, num_workers: int, model: ModelConfig
) -> list[str]:
    """Why ``num_workers`` workers of ``nodes.role``'s pool, started with ``args`` to serve
    ``model``, would not run on ``nodes``: each as a sentence; none when they fit."""
    tp = tensor_parallel_sizes(args)[nodes.role]
    gpus_per_rank = 1.0 if args.worker_num_gpus is None else args.worker_num_gpus
    cpus_per_rank = 1.0 if args.worker_num_cpus is None else args.worker_num_cpus
    problems = []
    try:
        check_tensor_parallel_size(model, tp)  # what pdserve refuses at start
    except ValueError as error:
        problems.append(str(error))
    if nodes.num_units % tp or nodes.num_gpus % tp:
        problems.append(f"TP {tp} leaves GPUs of a {nodes.num_gpus}-GPU node idle")
    per_node = workers_per_node(nodes, tp, gpus_per_rank)
    if per_node == 0:
        problems.append(f"a worker of {tp} ranks cannot fit one node: it would wait forever")
    if nodes.num_cpus < nodes.num_units * cpus_per_rank:
        problems.append(f"{nodes.num_cpus} CPUs cannot hold {nodes.num_units} ranks' reservations")
    if num_workers > nodes.max_nodes * per_node:
        problems.append(
            f"{num_workers} workers > {nodes.max_nodes} nodes x {per_node} workers per node"
        )
    if problems and "tensor_parallel_size" in problems[0]:
        return problems  # the heads do not split: no rank's share to weigh
    gpu_bytes = NODE_GPUS[nodes.node_type][1] * min(gpus_per_rank, 1.0)
    max_model_len = args.max_model_len or model.max_position_embeddings
    needed = rank_memory_bytes(model, tp, max_model_len)
    if needed > args.gpu_memory_utilization * gpu_bytes:
        problems.append(
            f"a rank of TP {tp} needs {needed / 1e9:.1f} GB for its weights and one "
            f"{max_model_len}-token sequence, more than {args.gpu_memory_utilization} of its GPU"
        )
    return problems


def is_loopback(host: str) -> bool:
    return host == "localhost" or ipaddress.ip_address(host).is_loopback


def assert_keys_guard_the_bind(args: Namespace) -> None:
    """A server that listens beyond its host has API keys; none is ever opened to anyone."""
    assert not args.allow_unauthenticated, "deployments never serve without API keys"
    if not is_loopback(args.host):
        assert args.api_key or args.api_key_file, f"--host {args.host} without API keys"
    # pdserve's own start-up check agrees (it raises where a deployment would not start).
    from router.gateway.server import check_bind_address

    check_bind_address(args.host, bool(args.api_key or args.api_key_file), False)


def kuberay_ray_start(params: dict[str, str], *, head: bool) -> str:
    """The `ray start` line KubeRay puts in $KUBERAY_GEN_RAY_START_CMD for these
    rayStartParams (ray-operator/controllers/ray/common/pod.go: it adds --block, sorts the keys,
    turns "true" into a bare flag and passes every other value as written)."""
    flags = ""
    for key, value in sorted({**params, "block": "true"}.items()):
        if value.lower() == "true":
            flags += f" --{key} "
        elif value.lower() != "false":
            flags += f" --{key}={value} "
    return ("ray start --head" if head else "ray start") + flags


def run_with_fakes(
    tmp_path: Path, command: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` with the stand-in `ray`, `pdserve` and `python3` first on PATH; their
    records land in ``tmp_path / "log"``, and ``tmp_path / "home"`` is $HOME."""
    bin_dir, log_dir, home = tmp_path / "bin", tmp_path / "log", tmp_path / "home"
    for folder in (bin_dir, log_dir, home):
        folder.mkdir(exist_ok=True)
    for name, text in (("ray", _FAKE_RAY), ("pdserve", _FAKE_PDSERVE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    if not (bin_dir / "python3").exists():
        (bin_dir / "python3").symlink_to(sys.executable)
    full_env = {
        "PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "HOME": str(home),
        "LOG": str(log_dir),
        **(env or {}),
    }
    return subprocess.run(
        command, env=full_env, capture_output=True, text=True, timeout=SHELL_TIMEOUT_S
    )


def recorded_pdserve_argv(tmp_path: Path) -> list[str]:
    record = tmp_path / "log" / "pdserve"
    assert record.exists(), "the command never started pdserve"
    return record.read_text().split("\0")[:-1]


def recorded_ray_start_argv(tmp_path: Path) -> list[str]:
    record = tmp_path / "log" / "ray-start"
    assert record.exists(), "the command never ran `ray start`"
    return record.read_text().splitlines()
