"""Streaming CRC32 of staged chunks, the same value on the sender and the receiver.

The sender folds in each chunk as it is gathered; the receiver folds in each chunk as read
back from its own cache after the scatter, so a wrong block, a torn copy or a bad scatter all
show. CUDA chunks are copied to the host first (the option is for verification runs).
"""

from __future__ import annotations

import zlib

import torch


class StreamingCrc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, chunk: torch.Tensor) -> None:
        data = chunk.detach().contiguous().view(-1).view(torch.uint8)
        if data.device.type != "cpu":
            data = data.cpu()
        self.value = zlib.crc32(data.numpy().data, self.value)
