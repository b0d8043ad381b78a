"""GPU transports: cuda_ipc (two processes, one GPU) and nccl (two GPUs). Skipped without CUDA."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import pytest
import torch

from kv_transfer import ChannelRendezvous, KVChannel, TransferTicket
from tests.kv_transfer.helpers import HOST, random_cache, small_layout
from tests.kv_transfer.peer import plain_rendezvous

pytestmark = pytest.mark.gpu


def _receive(rendezvous: dict[str, Any], device: str, ids: list[int], results: Any) -> None:
    rendezvous["extra"] = tuple(tuple(pair) for pair in rendezvous["extra"])
    layout = small_layout("bfloat16")
    cache = random_cache(layout, 32, seed=5).to(device)
    with KVChannel.connect(
        ChannelRendezvous(**rendezvous), layout, torch.device(device), 60.0
    ) as channel:
        for transfer_id in range(2):
            channel.recv_blocks(cache, ids, _ticket(transfer_id))
    results.put(cache.cpu().view(torch.int16).numpy())


SRC_IDS, DST_IDS = [3, 17, 9, 30, 1], [2, 8, 31, 0, 14]


def _spawn_receiver(listener: Any, receiver_device: str) -> tuple[Any, Any]:
    """A process that receives two transfers into `DST_IDS`; (process, its results queue)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    rendezvous = plain_rendezvous(listener.rendezvous)
    args = (rendezvous, receiver_device, DST_IDS, results)
    process = context.Process(target=_receive, args=args)
    process.start()
    return process, results


def _ticket(transfer_id: int) -> TransferTicket:
    return TransferTicket(transfer_id, f"r{transfer_id}", len(SRC_IDS), 60.0, checksum=True)


def _run_pair(transport: str, sender_device: str, receiver_device: str) -> None:
    layout = small_layout("bfloat16")
    src = random_cache(layout, 40, seed=4).to(sender_device)
    listener = KVChannel.listen(
        transport, layout, HOST, f"gpu-{transport}", torch.device(sender_device), chunk_bytes=4096
    )
    process, results = _spawn_receiver(listener, receiver_device)
    with listener, listener.accept(120.0) as sender:
        for transfer_id in range(2):
            sender.send_blocks(src, SRC_IDS, _ticket(transfer_id))
    received = torch.from_numpy(results.get(timeout=120))
    process.join(60)
    expected = random_cache(layout, 32, seed=5)
    expected[:, :, DST_IDS] = src.cpu()[:, :, SRC_IDS]
    assert torch.equal(received, expected.view(torch.int16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_ipc_between_two_processes_on_one_gpu() -> None:
    _run_pair("cuda_ipc", "cuda:0", "cuda:0")


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA GPUs (NCCL cannot pair two ranks on one GPU)",
)
def test_nccl_between_two_gpus() -> None:
    _run_pair("nccl", "cuda:0", "cuda:1")


def _busy_default_stream(seconds: float) -> None:
    """Queue about `seconds` of GPU work on the default stream (the engine's)."""
    clock_hz = torch.cuda.get_device_properties(0).clock_rate * 1000
    torch.cuda._sleep(int(seconds * clock_hz))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_transfer_does_not_wait_for_the_engines_queued_steps() -> None:
    """The channel copies on its own stream: with seconds of work queued on the default stream,
    a send finishes long before that work does (it synchronised the default stream before)."""
    layout = small_layout("bfloat16")
    src = random_cache(layout, 40, seed=4).to("cuda:0")
    listener = KVChannel.listen(
        "cuda_ipc", layout, HOST, "busy-cuda_ipc", torch.device("cuda:0"), chunk_bytes=4096
    )
    process, results = _spawn_receiver(listener, "cuda:0")
    with listener, listener.accept(120.0) as sender:
        sender.send_blocks(src, SRC_IDS, _ticket(0))
        torch.cuda.synchronize()
        _busy_default_stream(5.0)
        start = time.perf_counter()
        sender.send_blocks(src, SRC_IDS, _ticket(1))
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
    results.get(timeout=120)
    process.join(60)
    assert elapsed < 2.0, f"the send took {elapsed:.2f} s behind 5 s of queued work"
