"""What listens where: nothing on a wildcard address, no shared-memory file left behind."""

from __future__ import annotations

import glob

from kv_transfer import KVChannel
from kv_transfer.transports.shm import SHM_DIR
from tests.kv_transfer.helpers import (
    CPU,
    HOST,
    is_wildcard_hex,
    listening_tcp_sockets,
    open_pair,
    small_layout,
)

LOOPBACK_HEX = "0100007F"  # 127.0.0.1 as /proc/net/tcp prints it


def test_no_socket_of_an_open_channel_listens_on_a_wildcard_address() -> None:
    layout = small_layout()
    before = set(listening_tcp_sockets())  # other tests' sockets in this process (e.g. Ray's)
    listener = KVChannel.listen("gloo", layout, HOST, "sockets-pending", CPU)
    gloo = open_pair("gloo", layout, "sockets-gloo")
    shm = open_pair("shm", layout, "sockets-shm")
    try:
        sockets = [s for s in listening_tcp_sockets() if s not in before]
        assert sockets, "expected gloo's listeners and a pending control listener"
        wildcard = [s for s in sockets if is_wildcard_hex(s[0])]
        assert not wildcard, f"listening on a wildcard address: {wildcard}"
        assert all(address == LOOPBACK_HEX for address, _ in sockets), sockets
        assert (LOOPBACK_HEX, listener.rendezvous.port) in sockets
    finally:
        listener.close()
        for channel in (*gloo, *shm):
            channel.close()


def test_closing_releases_every_listener() -> None:
    before = set(listening_tcp_sockets())
    sender, receiver = open_pair("gloo", small_layout(), "sockets-release")
    assert set(listening_tcp_sockets()) - before  # gloo's own listeners, on loopback
    sender.close()
    receiver.close()
    assert set(listening_tcp_sockets()) <= before


def test_shared_memory_name_is_gone_once_both_sides_mapped_it() -> None:
    before = set(glob.glob(f"{SHM_DIR}/pdserve-kv-*"))
    sender, receiver = open_pair("shm", small_layout(), "sockets-unlinked")
    with sender, receiver:
        assert set(glob.glob(f"{SHM_DIR}/pdserve-kv-*")) <= before
