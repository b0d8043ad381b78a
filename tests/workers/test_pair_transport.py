"""``--kv-transport auto`` between real prefill and decode workers: the prefill worker asks the
decode worker where its cache lives and opens the channel over shm on one host, gloo across
hosts, and falls back to gloo for a pair whose shm channel cannot be set up. Every case's
greedy tokens equal the offline engine's."""

from __future__ import annotations

import errno
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from decode_worker.worker import DecodeWorker
from engine import LLM, GenerateRequest
from engine.messages import GetLocality, HandoffCall
from kv_transfer.locality import locality_of
from kv_transfer.policy import Locality, TransferConfig
from kv_transfer.transports.shm import SHM_DIR
from prefill_worker.pair_transports import PairTransports
from tests.workers.local_peer import LocalDecodePeer, answered
from tests.workers.test_local_pd import GATEWAY, _one_pair, _Pair, _workload

AUTO = TransferConfig(transport="auto", timeout_s=10.0)
T = TypeVar("T")


@pytest.fixture
def offline(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8)


class _OtherHostPeer(LocalDecodePeer):
    """A decode worker that says its cache is on another host (another boot, another
    /dev/shm): what a peer on a second node of the cluster answers."""

    def __init__(self, worker: DecodeWorker) -> None:
        super().__init__(worker)
        self.asked = 0

    def send(self, call: HandoffCall[T]) -> Future[T]:
        if not isinstance(call, GetLocality):
            return super().send(call)
        self.asked += 1
        answer: Future[Any] = answered(Locality("another-boot:7"))
        return answer


def _run_three(pair: _Pair, offline: LLM, prefix: str) -> None:
    prompts, params = _workload(3)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        pair.prefill.submit(GenerateRequest(f"{prefix}{i}", prompt, p, GATEWAY), "d0")
    pair.collector.wait_finished([(f"{prefix}{i}", 0) for i in range(3)], timeout_s=60)
    assert not pair.collector.failures
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, params)]
    assert [pair.collector.output(f"{prefix}{i}") for i in range(3)] == expected
    assert pair.decode.load().kv_usage == 0.0


def test_auto_opens_shm_to_a_decode_worker_on_this_host(llama_dir: Path, offline: LLM) -> None:
    with _one_pair(llama_dir, AUTO) as pair:
        assert pair.decode.locality() == pair.peer.send(GetLocality()).result()
        _run_three(pair, offline, "same-host")
        assert pair.prefill.channel_transports() == {"d0": "shm"}


def test_auto_opens_gloo_to_a_decode_worker_on_another_host(llama_dir: Path, offline: LLM) -> None:
    with _one_pair(llama_dir, AUTO, _OtherHostPeer) as pair:
        _run_three(pair, offline, "other-host")
        assert pair.prefill.channel_transports() == {"d0": "gloo"}
        assert isinstance(pair.peer, _OtherHostPeer) and pair.peer.asked == 1


def test_an_explicit_transport_is_used_without_asking_the_peer(
    llama_dir: Path, offline: LLM
) -> None:
    transfer = TransferConfig(transport="gloo", timeout_s=10.0)
    with _one_pair(llama_dir, transfer, _OtherHostPeer) as pair:
        _run_three(pair, offline, "explicit")
        assert pair.prefill.channel_transports() == {"d0": "gloo"}
        assert isinstance(pair.peer, _OtherHostPeer) and pair.peer.asked == 0


def test_a_pair_whose_shm_channel_fails_to_set_up_uses_gloo(
    llama_dir: Path, offline: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    tried: list[int] = []

    def full_dev_shm(nbytes: int, shm_dir: str = SHM_DIR) -> None:
        tried.append(nbytes)
        raise OSError(errno.ENOSPC, f"{shm_dir} is full")

    monkeypatch.setattr("kv_transfer.transports.shm.require_room", full_dev_shm)
    with _one_pair(llama_dir, AUTO) as pair:
        _run_three(pair, offline, "full-shm")
        assert pair.prefill.channel_transports() == {"d0": "gloo"}
        assert len(tried) == 1


def test_after_a_fallback_the_pair_keeps_the_network_transport() -> None:
    transports = PairTransports("auto", torch.device("cpu"))
    here = locality_of(torch.device("cpu"))

    def not_asked() -> Locality:
        raise AssertionError("the pair's transport is settled; its locality is not needed")

    assert transports.choose("d0", lambda: here) == "shm"
    assert transports.fall_back("d0", "shm", OSError("full")) == "gloo"
    assert transports.choose("d0", not_asked) == "gloo"
    assert transports.choose("d1", lambda: here) == "shm"  # other pairs keep shm
    assert transports.fall_back("d1", "gloo", OSError("refused")) is None  # nothing left to try
    explicit = PairTransports("shm", torch.device("cpu"))
    assert explicit.choose("d0", not_asked) == "shm"
    assert explicit.fall_back("d0", "shm", OSError("full")) is None  # named by the operator
