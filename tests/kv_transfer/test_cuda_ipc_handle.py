"""Opening the sender's CUDA IPC handle on the receiver: which GPU the buffer is mapped on.

torch's ``_new_shared_cuda`` maps the memory on the device index the handle names (a
``CUDAGuard`` of its first field, whatever device is current), and that index is the sender's
numbering of the GPU. Two processes that see the one GPU under different indices (another
``CUDA_VISIBLE_DEVICES``; ``auto`` pairs them by UUID) must map it under the receiver's index.
These run on a CPU build with torch's CUDA entry points stubbed; test_gpu.py runs the real thing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kv_transfer.errors import ProtocolError
from kv_transfer.transports.cuda_ipc import CudaSegment


class _Mapped(Exception):
    """Raised by the stub once it has the arguments (a CPU build cannot go further)."""


def _handle(sender_index: int) -> dict[str, Any]:
    fields = [sender_index, b"h" * 64, 8192, 0, b"/torch_ref", 0, b"e" * 64, True]
    return {"fields": [{"b64": "aA=="} if isinstance(f, bytes) else f for f in fields], "offset": 0}


@pytest.fixture
def mapped_on(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []

    def new_shared_cuda(*fields: Any) -> Any:
        calls.append(fields[0])
        raise _Mapped

    @contextlib.contextmanager
    def device(index: Any) -> Iterator[None]:
        yield

    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", new_shared_cuda, raising=False)
    return calls


def test_the_buffer_is_mapped_on_the_receivers_index_of_the_gpu(mapped_on: list[int]) -> None:
    with pytest.raises(_Mapped):
        CudaSegment.open(_handle(sender_index=1), 4096, torch.device("cuda", 0))
    with pytest.raises(_Mapped):  # "cuda" alone: the current device
        CudaSegment.open(_handle(sender_index=1), 4096, torch.device("cuda"))
    assert mapped_on == [0, 2]


def test_a_handle_without_its_eight_fields_is_a_protocol_error(mapped_on: list[int]) -> None:
    handle = _handle(0)
    handle["fields"] = handle["fields"][:3]
    with pytest.raises(ProtocolError, match="3 fields"):
        CudaSegment.open(handle, 4096, torch.device("cuda", 0))
    assert mapped_on == []
