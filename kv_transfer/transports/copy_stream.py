"""The CUDA stream a channel end runs its transfers on, its own rather than the engine's.

A transfer's copies (gather into staging, scatter into the cache, the cuda_ipc receiver's copy
out of the sender's cache) and NCCL's ordering against them (a send or receive waits for the
current stream) then queue behind nothing but the channel's own work, and its synchronisations
wait for nothing else: on the default stream the transfer thread's every chunk waited for the
decode steps the engine thread had queued, and those steps queued behind the chunk's copies.
The blocks a transfer touches are leased to it (sent from after the prefill step that wrote
them was read back on the host; received into blocks no sequence uses until the receive
returns), so no ordering with the engine's stream is needed. On CPU it is no stream at all.

Current streams are per thread in torch, so `active()` affects the calling thread only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class CopyStream:
    def __init__(self, device: torch.device) -> None:
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Make this the calling thread's current stream (CPU: nothing) for the block."""
        if self._stream is None:
            yield
            return
        with torch.cuda.stream(self._stream):
            yield

    def synchronize(self) -> None:
        """Wait until the copies queued on it so far are done (CPU: they are)."""
        if self._stream is not None:
            self._stream.synchronize()
