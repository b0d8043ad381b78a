"""Channel set-up: layout checks at the handshake, strangers refused, no wildcard listeners."""

from __future__ import annotations

import dataclasses
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kv_transfer import (
    ChannelRendezvous,
    KVChannel,
    LayoutMismatchError,
    TransferError,
    TransferTicket,
    TransferTimeoutError,
    make_fake_channel_pair,
)
from tests.kv_transfer.helpers import CPU, HOST, open_pair, small_layout
from tests.kv_transfer.test_layout import MISMATCHES

TRANSPORTS = ["gloo", "shm", "fake"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(("field", "value"), MISMATCHES)
def test_layout_mismatch_refused_on_both_sides(transport: str, field: str, value: object) -> None:
    sender_layout = small_layout()
    receiver_layout = dataclasses.replace(sender_layout, **{field: value})
    listener = KVChannel.listen(transport, sender_layout, HOST, f"mm-{transport}-{field}", CPU)
    with listener, ThreadPoolExecutor(1) as pool:
        connecting = pool.submit(KVChannel.connect, listener.rendezvous, receiver_layout, CPU, 10)
        with pytest.raises(LayoutMismatchError) as on_sender:
            listener.accept(10)
        with pytest.raises(LayoutMismatchError) as on_receiver:
            connecting.result()
    mine, theirs = getattr(sender_layout, field), value
    assert str(on_sender.value) == (
        f"KV layout mismatch on {field}: this side has {mine}, the peer has {theirs}"
    )
    assert str(on_receiver.value) == (
        f"KV layout mismatch on {field}: this side has {theirs}, the peer has {mine}"
    )


def test_fake_pair_refuses_another_layout() -> None:
    layout = small_layout()
    with pytest.raises(LayoutMismatchError, match="on head_dim"):
        make_fake_channel_pair(layout, receiver_layout=dataclasses.replace(layout, head_dim=16))


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_stranger_with_wrong_token_is_dropped(transport: str) -> None:
    layout = small_layout()
    listener = KVChannel.listen(transport, layout, HOST, f"stranger-{transport}", CPU)
    forged = dataclasses.replace(listener.rendezvous, extra=(("token", "0" * 32),))
    with listener, ThreadPoolExecutor(1) as pool:
        accepting = pool.submit(listener.accept, 20)
        with pytest.raises(TransferError, match="refused"):
            KVChannel.connect(forged, layout, CPU, 5)
        receiver = KVChannel.connect(listener.rendezvous, layout, CPU, 20)
        sender = accepting.result()
    assert not sender.broken and not receiver.broken
    sender.close()
    receiver.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_listening_on_a_wildcard_address_is_refused(transport: str, host: str) -> None:
    with pytest.raises(ValueError, match="wildcard"):
        KVChannel.listen(transport, small_layout(), host, "wild", CPU)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_accept_times_out_when_nobody_connects(transport: str) -> None:
    with KVChannel.listen(transport, small_layout(), HOST, f"alone-{transport}", CPU) as listener:
        start = time.monotonic()
        with pytest.raises(TransferTimeoutError):
            listener.accept(0.5)
        assert time.monotonic() - start < 5.0


def test_connect_to_nobody_fails_fast() -> None:
    with KVChannel.listen("shm", small_layout(), HOST, "gone", CPU) as listener:
        rendezvous: ChannelRendezvous = listener.rendezvous
    start = time.monotonic()
    with pytest.raises(TransferError):
        KVChannel.connect(rendezvous, small_layout(), CPU, 10)
    assert time.monotonic() - start < 5.0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_channels_move_one_way(transport: str) -> None:
    sender, receiver = open_pair(transport, small_layout(), f"oneway-{transport}")
    with sender, receiver:
        assert sender.role == "sender" and receiver.role == "receiver"
        cache = torch.zeros(3, 2, 4, 4, 2, 8)
        ticket = TransferTicket(0, "r", 1, 1.0)
        with pytest.raises(RuntimeError, match="one way"):
            receiver.send_blocks(cache, [0], ticket)
        with pytest.raises(RuntimeError, match="one way"):
            sender.recv_blocks(cache, [0], ticket)


def test_silent_stranger_delays_the_receiver_only_briefly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kv_transfer.transports.control.HELLO_TIMEOUT_S", 0.3)
    layout = small_layout()
    listener = KVChannel.listen("shm", layout, HOST, "silent-stranger", CPU)
    rendezvous = listener.rendezvous
    with (
        listener,
        ThreadPoolExecutor(1) as pool,
        socket.create_connection((rendezvous.host, rendezvous.port)),
    ):
        accepting = pool.submit(listener.accept, 20)
        receiver = KVChannel.connect(rendezvous, layout, CPU, 20)
        with receiver, accepting.result() as sender:
            assert not sender.broken and not receiver.broken


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
@pytest.mark.parametrize("transport", ["nccl", "cuda_ipc"])
def test_gpu_transports_say_clearly_that_they_need_cuda(transport: str) -> None:
    with pytest.raises(RuntimeError, match="needs CUDA"):
        KVChannel.listen(transport, small_layout(), HOST, "no-gpu", torch.device("cuda"))
    with pytest.raises(ValueError, match="CUDA caches"):
        KVChannel.listen(transport, small_layout(), HOST, "no-gpu", CPU)


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_cpu_transports_refuse_gpu_caches(transport: str) -> None:
    with pytest.raises(ValueError, match="CPU caches"):
        KVChannel.listen(transport, small_layout(), HOST, "cpu-only", torch.device("cuda", 0))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_closing_the_listener_ends_a_pending_accept(transport: str) -> None:
    listener = KVChannel.listen(transport, small_layout(), HOST, f"shut-{transport}", CPU)
    with ThreadPoolExecutor(1) as pool:
        accepting = pool.submit(listener.accept, 30)
        time.sleep(0.2)  # let accept block (if it has not yet, it fails at once all the same)
        start = time.monotonic()
        listener.close()
        with pytest.raises(TransferError):
            accepting.result(timeout=10)
        assert time.monotonic() - start < 5.0
