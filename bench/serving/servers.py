"""Serving systems the comparison starts and stops: pdserve in a given pool layout, and vLLM's
OpenAI-compatible server from its own virtual environment.

A ``RunningServer`` starts the command, waits until its health route answers 200, and on exit
sends SIGINT (pdserve shuts its Ray workers down on it), then kills what is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx


@dataclass(frozen=True, slots=True)
class ServerSpec:
    name: str  # the label in results, e.g. "pdserve 1P1D"
    argv: tuple[str, ...]  # the command that serves
    port: int  # its HTTP port on 127.0.0.1
    health_path: str  # a GET that answers 200 once it serves
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


PDSERVE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
ROUND_SEED_STRIDE = 1000  # benchmarks' rounds: round i's seed is the base + i * this


def cores_per_worker(num_workers: int, given: int | None = None) -> int:
    """The Ray CPUs (and so the torch threads) each of ``num_workers`` workers reserves:
    ``given``, else all cores but 2 split evenly, 0 (no reservation) where that is none."""
    if given is not None:
        return given
    return max(0, ((os.cpu_count() or 1) - 2) // max(1, num_workers))


def rotated(specs: Sequence[ServerSpec], round_index: int) -> list[ServerSpec]:
    """A round's order of the systems: no system always runs first, on a machine fresh from
    idling."""
    shift = round_index % len(specs) if specs else 0
    return [*specs[shift:], *specs[:shift]]


def pdserve_serve(
    name: str, port: int, model_dir: str, served_name: str, extra_args: Sequence[str] = ()
) -> ServerSpec:
    """``pdserve serve`` as a user starts it: the model (float32), its name and the HTTP port,
    no gRPC, the layout and settings it picks itself unless ``extra_args`` name them."""
    argv = (
        sys.executable, "-m", "router.cli", "serve", "--model", model_dir,
        "--served-model-name", served_name, "--dtype", "float32",
        "--http-port", str(port), "--grpc-port", "-1", *extra_args,
    )  # fmt: skip
    return ServerSpec(name, argv, port, "/health", PDSERVE_ENV)


def pdserve_server(
    name: str,
    num_prefill: int,
    num_decode: int,
    port: int,
    model_dir: str,
    served_name: str,
    num_kv_blocks: int,
    cores_per_worker: int = 1,
    bind_cpus: bool = False,
    extra_args: tuple[str, ...] = (),
) -> ServerSpec:
    """``cores_per_worker``: the Ray CPUs each worker reserves, which Ray turns into its torch
    threads (OMP_NUM_THREADS); ``bind_cpus``: on cores of their own (``--bind-worker-cpus``);
    ``extra_args``: more ``pdserve serve`` flags."""
    argv = (
        sys.executable, "-m", "router.cli", "serve",
        "--model", model_dir, "--served-model-name", served_name, "--dtype", "float32",
        "--prefill", str(num_prefill), "--decode", str(num_decode),
        "--kv-transport", "shm", "--num-kv-blocks", str(num_kv_blocks),
        "--worker-num-cpus", str(cores_per_worker), "--http-port", str(port), "--grpc-port", "-1",
    ) + (("--bind-worker-cpus",) if bind_cpus else ()) + extra_args  # fmt: skip
    return ServerSpec(name, argv, port, "/health", PDSERVE_ENV)


def vllm_server(
    vllm_python: str,
    port: int,
    model_dir: str,
    served_name: str,
    max_model_len: int,
    kv_cache_gib: int = 1,
    extra_args: tuple[str, ...] = (),
) -> ServerSpec:
    """``extra_args``: more flags of vLLM's OpenAI server."""
    argv = (
        vllm_python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_dir, "--served-model-name", served_name, "--dtype", "float32",
        "--max-model-len", str(max_model_len), "--enforce-eager",
        "--host", "127.0.0.1", "--port", str(port), *extra_args,
    )  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
    return ServerSpec("vLLM (CPU)", argv, port, "/health", env)


class RunningServer:
    def __init__(self, spec: ServerSpec, log_path: Path, start_timeout_s: float = 600) -> None:
        self.spec = spec
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> RunningServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self._process = subprocess.Popen(
            self.spec.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.spec.env},
        )
        self._wait_healthy()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def _wait_healthy(self) -> None:
        assert self._process is not None
        url = f"http://127.0.0.1:{self.spec.port}{self.spec.health_path}"
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited at start-up; see {self.log_path}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.spec.name} not healthy in {self.start_timeout_s:g} s")
