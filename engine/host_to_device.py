"""Host values as device tensors without waiting for the device.

``torch.tensor(values, device="cuda")`` is a blocking copy: it waits for every kernel queued
before it, so a step built with it cannot be launched while the step before still runs (async
scheduling's overlap). A copy from host memory made with ``non_blocking=True`` is queued behind
those kernels instead; the host buffer is staged by the driver before the call returns.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(
    values: Sequence[int] | Sequence[float] | Sequence[bool] | np.ndarray,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """``values`` as a 1-D (or the array's shape) tensor of ``dtype`` on ``device``."""
    host = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values)
    return host.to(device=device, dtype=dtype, non_blocking=True)
