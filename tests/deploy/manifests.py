"""Shared pieces of the deploy/ tests: reading the manifests, the pdserve argv inside them, and
running their shell snippets with stand-in `ray` and `pdserve` commands."""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
import subprocess
import sys
from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
NODE_TYPES = {"prefill": "prefill_gpu", "decode": "decode_gpu"}  # pdserve role -> node type
OTHER_ROLE = {"prefill": "decode", "decode": "prefill"}
REMOTE_SOURCE = "/home/ubuntu/pdserve"  # where cluster.yaml puts the source on every node
KEY_FILE = "/home/ubuntu/pdserve-api-keys"  # the gateway's keys on the `ray up` head
SHELL_TIMEOUT_S = 30

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
