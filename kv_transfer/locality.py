"""This process's `Locality`: which shared-memory filesystem it sees and which GPU holds its cache.

Two processes see one shared-memory filesystem when they run under one kernel boot and their
``/dev/shm`` is one mount (containers usually get a mount each): then the boot id and the
mount's device number are equal. A GPU is named by its UUID, which no other GPU shares.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kv_transfer.policy import Locality
from kv_transfer.transports.shm import SHM_DIR

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def shared_memory_name(shm_dir: str = SHM_DIR, boot_id: Path = BOOT_ID) -> str:
    """``"<boot id>:<device of shm_dir>"``, or "" where either is missing (no shm transport)."""
    try:
        return f"{boot_id.read_text().strip()}:{os.stat(shm_dir).st_dev}"
    except OSError:
        return ""


def locality_of(device: torch.device) -> Locality:
    """The locality of a KV cache on ``device`` held by this process."""
    gpu = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""
    return Locality(shared_memory_name(), gpu)
