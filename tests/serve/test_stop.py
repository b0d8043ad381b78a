"""Stopping `pdserve serve` with SIGTERM while streams are in flight: new requests get 503 with
Retry-After and /health 503 during the drain, every stream ends (finished, or cut off with an
error saying why as its last event before [DONE]), and every process of the server is gone
within the drain timeout + 10 s."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.serve_process import ServeProcess

pytestmark = pytest.mark.timeout(600)

DRAIN_S = 3.0
STOP_LIMIT_S = DRAIN_S + 10.0  # SIGTERM to the last process of the server gone
# One sequence at a time on each worker: the streams queue behind each other, so together they
# take far longer than the drain and some are still running when it ends.
NUM_STREAMS = 16
MAX_TOKENS = 480  # the tiny Llama holds 512 positions
WAIT_S = 120.0


class Stream(threading.Thread):
    """One streamed completion, read on a thread: its status, then its non-empty lines."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.status: int | None = None
        self.responded = threading.Event()  # its status line arrived
        self.lines: list[str] = []

    def run(self) -> None:
        body = {"model": "tiny", "prompt": "def main():", "max_tokens": MAX_TOKENS}
        body |= {"ignore_eos": True, "stream": True}
        with (
            httpx.Client(timeout=WAIT_S) as client,
            client.stream("POST", self.url + "/completions", json=body) as response,
        ):
            self.status = response.status_code
            self.responded.set()
            self.lines.extend(line for line in response.iter_lines() if line)

    def ending(self) -> tuple[str, Any]:
        """("finished", its finish reason) or ("cut off", its error), from its last events."""
        assert self.lines[-1] == "data: [DONE]", self.lines[-3:]
        last = json.loads(self.lines[-2].removeprefix("data: "))
        if "error" in last:
            return "cut off", last["error"]
        return "finished", last["choices"][0]["finish_reason"]


def _wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _status(url: str, method: str = "GET", **kwargs: Any) -> httpx.Response:
    return httpx.request(method, url, timeout=WAIT_S, **kwargs)


def test_sigterm_drains_ends_every_stream_and_stops_every_process(llama_dir: Path) -> None:
    server = ServeProcess(
        llama_dir,
        *("--prefill", "1", "--decode", "1", "--worker-num-cpus", "0", "--dtype", "float32"),
        *("--block-size", "8", "--num-kv-blocks", "200", "--served-model-name", "tiny"),
        *("--http-port", "0", "--grpc-port", "-1", "--max-num-seqs", "1"),
        *("--drain-timeout-s", str(DRAIN_S)),
    )
    try:
        url = server.wait_for_banner()
        health_url = url.removesuffix("/v1") + "/health"
        streams = [Stream(url) for _ in range(NUM_STREAMS)]
        for stream in streams:
            stream.start()
        _wait_for(lambda: all(s.responded.is_set() for s in streams), "every stream's status")
        assert [s.status for s in streams] == [200] * NUM_STREAMS
        processes = server.tree()

        server.process.send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()

        _wait_for(lambda: _status(health_url).status_code == 503, "/health to say 503")
        assert _status(health_url).json()["status"] == "shutting_down"
        body = {"model": "tiny", "prompt": "late", "max_tokens": 2}
        refused = _status(url + "/completions", "POST", json=body)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "5"
        assert refused.json()["error"]["code"] == "shutting_down"
        for stream in streams:
            stream.join(timeout=WAIT_S)
        endings = [stream.ending() for stream in streams]
        for how, detail in endings:
            if how == "finished":
                assert detail == "length"
            else:
                assert detail["code"] == "shutting_down", detail
                assert f"drain timeout of {DRAIN_S:g} s ran out" in detail["message"]
        assert any(how == "cut off" for how, _ in endings), endings

        server.wait_until_gone(processes, STOP_LIMIT_S - (time.monotonic() - signalled_at))
        assert server.process.wait(timeout=10) == 0, server.output()
        assert f"ended {sum(how == 'cut off' for how, _ in endings)} requests" in server.output()
    finally:
        if server.process.poll() is None:
            server.kill_tree()


def test_a_negative_drain_timeout_is_refused_naming_the_flag(llama_dir: Path) -> None:
    command = [sys.executable, "-m", "router.cli", "serve", "--model", str(llama_dir)]
    result = subprocess.run(
        [*command, "--drain-timeout-s", "-1"], capture_output=True, text=True, timeout=WAIT_S
    )
    assert result.returncode == 2
    assert "--drain-timeout-s must be >= 0, got -1" in result.stderr
