"""`pdserve serve` on a Ray of its own listens on loopback only: every TCP port its process tree
opens (the front doors, Ray's GCS, raylet and runtime-env agent, the workers' gRPC servers) is
on 127.0.0.1, without RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER set."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.fixtures.process_tree import Listener, listeners
from tests.fixtures.serve_process import ServeProcess

pytestmark = pytest.mark.timeout(600)

# processes of the tree that open a port, by a part of their title
RAY_LISTENERS = (
    "gcs_server",
    "raylet",
    "ray::RuntimeEnvAgent",
    "ray::WorkerActor",
)
WAIT_S = 60.0


def _listeners_once_up(server: ServeProcess) -> list[Listener]:
    """The tree's listeners, once the server and each of ``RAY_LISTENERS`` has one (Ray starts
    some of them in the background)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        found = listeners(server.tree())
        missing = [
            name for name in RAY_LISTENERS if not any(name in x.process.title for x in found)
        ]
        if not any(x.process.pid == server.pid for x in found):
            missing.append("the server")
        if not missing:
            return found
        assert time.monotonic() < deadline, f"no listener of {missing}: {found}"
        time.sleep(0.1)


def test_serve_on_its_own_ray_listens_on_loopback_only(llama_dir: Path) -> None:
    server = ServeProcess(
        llama_dir,
        *("--prefill", "1", "--decode", "1", "--worker-num-cpus", "0", "--dtype", "float32"),
        *("--block-size", "8", "--num-kv-blocks", "200", "--served-model-name", "tiny"),
        *("--http-port", "0", "--grpc-port", "0"),
    )
    try:
        url = server.wait_for_banner()
        body = {"model": "tiny", "prompt": "def main():", "max_tokens": 4}
        response = httpx.post(url + "/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text

        found = _listeners_once_up(server)

        exposed = [f"{x.address}:{x.port} ({x.process.title})" for x in found if not x.is_loopback]
        assert not exposed, "listening beyond loopback:\n" + "\n".join(exposed)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0, server.output()
    finally:
        if server.process.poll() is None:
            server.kill_tree()
