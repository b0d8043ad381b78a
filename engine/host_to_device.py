"""Host values onto the device without waiting for the device.

``torch.tensor(values, device="cuda")`` is a blocking copy: it waits for every kernel queued
before it, so a step built with it cannot be launched while the step before still runs (async
scheduling's overlap). A copy from pageable host memory may wait too (the driver may sync the
stream to stage it). So the values are put in page-locked memory first (torch's caching host
allocator, which keeps each buffer until its copy is done) and copied with
``non_blocking=True``: the copy is queued behind those kernels and the host goes on.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(
    values: Sequence[int] | Sequence[float] | Sequence[bool] | np.ndarray,
    dtype: torch.dtype | None,
    device: torch.device,
) -> torch.Tensor:
    """``values`` as a tensor of ``dtype`` (None: an array's own) on ``device`` (the array's
    shape; 1-D for a list)."""
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(values)
        host = host if dtype is None else host.to(dtype)
    else:
        host = torch.tensor(values, dtype=dtype)
    return _staged(host, device).to(device, non_blocking=True)


def copy_to_device(target: torch.Tensor, values: np.ndarray) -> None:
    """Copy ``values`` into ``target`` (a device tensor of their shape), queued on the stream."""
    target.copy_(_staged(torch.from_numpy(values), target.device), non_blocking=True)


def _staged(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return host.pin_memory() if device.type == "cuda" else host
