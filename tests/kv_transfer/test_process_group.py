"""The process-group protocol that gloo and nccl share: the order each end issues its operations
in (NCCL ignores tags and pairs sends with receives in issue order) and the group's timeout."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kv_transfer import KVChannel, TransferTicket
from kv_transfer.deadline import Deadline
from kv_transfer.transports.process_group import GROUP_TIMEOUT, make_group
from tests.kv_transfer.helpers import HOST, open_pair, random_cache, small_layout, transfer


class _RecordingGroup:
    """A process group that records each send / recv it is asked for, in issue order."""

    def __init__(self, group: Any) -> None:
        self._group = group
        self.ops: list[tuple[str, int]] = []  # ("send" | "recv", nbytes)

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Any:
        self.ops.append(("send", tensors[0].nbytes))
        return self._group.send(tensors, peer, tag)

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Any:
        self.ops.append(("recv", tensors[0].nbytes))
        return self._group.recv(tensors, peer, tag)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)


def _record(channel: KVChannel) -> _RecordingGroup:
    endpoint: Any = channel._endpoint
    endpoint._group = _RecordingGroup(endpoint._group)
    return endpoint._group


@pytest.mark.parametrize("checksum", [False, True])
def test_both_ends_issue_a_transfers_operations_in_the_same_order(checksum: bool) -> None:
    layout = small_layout()  # 1536 B a block: two blocks a 4096-byte chunk
    src, dst = random_cache(layout, 8, 0), random_cache(layout, 8, 1)
    sender, receiver = open_pair("gloo", layout, f"order-{checksum}", chunk_bytes=4096)
    sent_ops, received_ops = _record(sender), _record(receiver)
    with sender, receiver:
        for transfer_id in range(2):
            ticket = TransferTicket(transfer_id, f"req-{transfer_id}", 5, 20.0, checksum=checksum)
            transfer(sender, receiver, (src, [0, 1, 2, 3, 5]), (dst, [7, 6, 5, 4, 3]), ticket)
    assert torch.equal(dst[:, :, [7, 6, 5, 4, 3]], src[:, :, [0, 1, 2, 3, 5]])
    # per transfer: header, 3 chunks, trailer one way, then the ack back
    assert len(sent_ops.ops) == 2 * 6
    mirrored = [("recv" if op == "send" else "send", nbytes) for op, nbytes in sent_ops.ops]
    assert mirrored == received_ops.ops


class _FakeNccl:
    """Stands in for ProcessGroupNCCL on a CPU build: keeps the options it was built with."""

    built_with: list[Any] = []

    class Options:
        _timeout: timedelta | None = None

    def __init__(self, store: Any, rank: int, size: int, options: Any) -> None:
        _FakeNccl.built_with.append(options)


def test_an_nccl_group_outlasts_every_transfer_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL's watchdog tears the whole process down when an operation outlives the group's
    timeout, so it is not what is left of the set-up deadline: the waits carry the deadlines."""
    monkeypatch.setattr(dist, "ProcessGroupNCCL", _FakeNccl, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _FakeNccl.built_with.clear()
    make_group("nccl", dist.HashStore(), 0, HOST, torch.device("cuda", 0), Deadline.after(5.0))
    (options,) = _FakeNccl.built_with
    assert options._timeout == GROUP_TIMEOUT
    assert timedelta(hours=1) <= GROUP_TIMEOUT  # far past any transfer's timeout_s
