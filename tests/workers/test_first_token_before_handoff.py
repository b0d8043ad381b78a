"""A prefill worker's first token never waits for its KV hand-off: the step's tokens are on the
gateway's queue before the hand-off begins, and the hand-off runs on a lane thread of its own
(docs/request_path.md)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import TypeVar

from decode_worker.worker import DecodeWorker
from engine import GenerateRequest, SamplingParams
from engine.messages import HandoffCall
from kv_transfer.policy import TransferConfig
from tests.workers.local_peer import LocalDecodePeer
from tests.workers.test_local_pd import GATEWAY, _eventually, _one_pair

T = TypeVar("T")


class _HeldDecodePeer(LocalDecodePeer):
    """A decode worker that answers no hand-off call until ``release`` is set."""

    def __init__(self, worker: DecodeWorker) -> None:
        super().__init__(worker)
        self.release = threading.Event()
        self.num_calls = 0

    def send(self, call: HandoffCall[T]) -> Future[T]:
        self.num_calls += 1

        def answer_once_released() -> T:
            self.release.wait()
            return call.run_on(self.worker)

        return self._executor.submit(answer_once_released)


def test_the_first_token_reaches_the_gateway_while_its_hand_off_is_held(llama_dir: Path) -> None:
    transfer = TransferConfig(transport="gloo", timeout_s=10.0)
    with _one_pair(llama_dir, transfer, _HeldDecodePeer) as pair:
        peer = pair.peer
        assert isinstance(peer, _HeldDecodePeer)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        pair.prefill.submit(GenerateRequest("h", [5, 6, 7, 8, 9], params, GATEWAY), "d0")
        _eventually(lambda: 0 in pair.collector.tokens["h"][0])  # the first token is out
        _eventually(lambda: peer.num_calls >= 1)  # and its hand-off has begun, held
        assert 1 not in pair.collector.tokens["h"][0]
        peer.release.set()
        pair.collector.wait_finished([("h", 0)], timeout_s=30)
        assert not pair.collector.failures
        assert len(pair.collector.output("h")) == 4
