"""The process-group protocol that gloo and nccl share: the order each end issues its operations
in (NCCL ignores tags and pairs sends with receives in issue order) and the group's timeout."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kv_transfer import KVChannel, TransferTicket
from kv_transfer.deadline import Deadline
from kv_transfer.transports.process_group import GROUP_TIMEOUT, _wait, make_group
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


def test_an_nccl_group_leaves_errors_to_the_waits_not_the_watchdog(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With TORCH_NCCL_ASYNC_ERROR_HANDLING at its default (3) NCCL's watchdog kills the process
    on any error it sees: a dead peer, or the comm a timed-out wait aborted under the channel's
    other operations. Each group is built with it at 0 unless the deployment set it."""
    seen: list[str | None] = []

    class _EnvRecordingNccl(_FakeNccl):
        def __init__(self, store: Any, rank: int, size: int, options: Any) -> None:
            seen.append(os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))

    monkeypatch.setattr(dist, "ProcessGroupNCCL", _EnvRecordingNccl, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    make_group("nccl", dist.HashStore(), 0, HOST, torch.device("cuda", 0), Deadline.after(5.0))
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # the deployment's choice wins
    make_group("nccl", dist.HashStore(), 1, HOST, torch.device("cuda", 0), Deadline.after(5.0))
    assert seen == ["0", "1"]


class _TimeoutRecordingWork:
    def __init__(self) -> None:
        self.timeouts: list[timedelta] = []

    def wait(self, timeout: timedelta) -> bool:
        self.timeouts.append(timeout)
        return True


def test_a_wait_under_a_millisecond_from_its_deadline_still_has_a_timeout() -> None:
    """torch truncates a wait's timeout to whole milliseconds, and 0 ms is no timeout: an NCCL
    wait would then not block (nor time out) at all."""
    work = _TimeoutRecordingWork()
    _wait(work, Deadline.after(0.0004), "the last chunk")
    (timeout,) = work.timeouts
    assert timeout >= timedelta(milliseconds=1)
