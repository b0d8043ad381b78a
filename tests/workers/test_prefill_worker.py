"""A prefill worker's bookkeeping and hand-off failures, with a decode worker in one process."""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from engine import GenerateRequest, SamplingParams
from engine.messages import HandoffCall, JoinChannel
from kv_transfer import TransferError
from kv_transfer.policy import TransferConfig
from tests.engine.test_parity import make_prompts
from tests.workers.local_peer import LocalDecodePeer
from tests.workers.test_local_pd import GATEWAY, _cluster, _eventually, _one_pair

T = TypeVar("T")


def test_a_request_that_ends_on_its_first_token_is_forgotten(llama_dir: Path) -> None:
    """max_tokens=1: the request finishes on the prefill worker and is never handed off. Its
    target (the decode worker it was meant for) leaked, and ``retarget`` still took it."""
    cluster = _cluster(llama_dir, 1, 1, TransferConfig(transport="gloo", timeout_s=10.0))
    try:
        (prefill,) = cluster.prefills
        params = SamplingParams(temperature=0.0, max_tokens=1)
        for i, prompt in enumerate(make_prompts(seed=29)[2:5]):
            prefill.submit(GenerateRequest(f"one{i}", prompt, params, GATEWAY), "d0")
        cluster.collector.wait_finished([(f"one{i}", 0) for i in range(3)], timeout_s=30)
        assert not cluster.collector.failures
        assert not prefill.retarget("one0", "d0")  # too late: it is over
        prefill.load()  # the router's load poll sweeps the rest
        assert not prefill._targets
    finally:
        cluster.shutdown()


class _UnjoinableDecodePeer(LocalDecodePeer):
    """Its end of every new channel fails at once (a full /dev/shm, say)."""

    def send(self, call: HandoffCall[T]) -> Future[T]:
        if not isinstance(call, JoinChannel):
            return super().send(call)

        def fail() -> bool:
            raise TransferError("cannot map the sender's shared-memory segment")

        failed: Future[Any] = self._executor.submit(fail)
        return failed


def test_a_decode_worker_that_cannot_join_the_channel_fails_the_hand_off_at_once(
    llama_dir: Path,
) -> None:
    """The prefill worker waited out its whole deadline for a receiver that had already given
    up (holding up every hand-off to that decode worker), then reported a bare accept timeout;
    now the decode worker's error ends the wait and is the one reported."""
    transfer = TransferConfig(transport="gloo", timeout_s=30.0)
    with _one_pair(llama_dir, transfer, _UnjoinableDecodePeer) as pair:
        prompt = make_prompts(seed=29)[4]
        request = GenerateRequest("u", prompt, SamplingParams(max_tokens=5), GATEWAY)
        started = time.monotonic()
        pair.prefill.submit(request, "d0")
        pair.collector.wait_finished([("u", 0)], timeout_s=15)
        assert time.monotonic() - started < 15
        assert "cannot map the sender's shared-memory segment" in pair.collector.failures["u"]
        assert pair.collector.retryable["u"]
        assert pair.prefill.load().kv_usage == 0.0
        _eventually(lambda: pair.decode.load().kv_usage == 0.0)  # the reservation came back
