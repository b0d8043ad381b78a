"""``--kv-transport auto``'s rule per prefill -> decode pair, the locality it reads, and the
shared-memory room check that keeps a full /dev/shm from killing a worker with SIGBUS."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from kv_transfer.locality import locality_of, shared_memory_name
from kv_transfer.policy import Locality, describe_auto, network_transport, transport_between
from kv_transfer.transports.shm import SHM_DIR, HostSegment, require_room

HOST_A, HOST_B = "boot-a:41", "boot-b:41"


@pytest.mark.parametrize(
    ("device_type", "sender", "receiver", "expected"),
    [
        ("cpu", Locality(HOST_A), Locality(HOST_A), "shm"),
        ("cpu", Locality(HOST_A), Locality(HOST_B), "gloo"),
        ("cpu", Locality(HOST_A), Locality("boot-a:42"), "gloo"),  # another /dev/shm mount
        ("cpu", Locality(""), Locality(""), "gloo"),  # no /dev/shm on either side
        ("cuda", Locality(HOST_A, "GPU-0"), Locality(HOST_A, "GPU-0"), "cuda_ipc"),
        ("cuda", Locality(HOST_A, "GPU-0"), Locality(HOST_A, "GPU-1"), "nccl"),
        ("cuda", Locality(HOST_A, "GPU-0"), Locality(HOST_B, "GPU-1"), "nccl"),
    ],
)
def test_a_pair_on_one_host_or_gpu_takes_the_local_transport(
    device_type: str, sender: Locality, receiver: Locality, expected: str
) -> None:
    assert transport_between(device_type, sender, receiver) == expected
    assert transport_between(device_type, receiver, sender) == expected
    assert expected in describe_auto(device_type)
    assert network_transport(device_type) in describe_auto(device_type)


def test_this_process_and_its_children_share_one_name(tmp_path: Path) -> None:
    name = shared_memory_name()
    assert name and name == locality_of(torch.device("cpu")).shared_memory
    assert locality_of(torch.device("cpu")).gpu == ""
    other_boot = tmp_path / "boot_id"
    other_boot.write_text("another-boot\n")
    assert shared_memory_name(boot_id=other_boot) != name
    assert shared_memory_name(boot_id=other_boot).startswith("another-boot:")
    assert shared_memory_name(shm_dir=str(tmp_path / "missing")) == ""
    assert shared_memory_name(boot_id=tmp_path / "missing") == ""


def test_a_shared_memory_segment_needs_room_in_dev_shm() -> None:
    free = os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize
    require_room(4096)
    with pytest.raises(OSError) as error:
        require_room(free + (1 << 40))
    assert error.value.errno == errno.ENOSPC
    assert "MiB free and a shm channel needs" in str(error.value)
    assert "--kv-transport gloo" in str(error.value)


def test_a_segment_is_refused_before_it_is_made_when_there_is_no_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = set(os.listdir(SHM_DIR))

    def no_room(nbytes: int, shm_dir: str = SHM_DIR) -> None:
        raise OSError(errno.ENOSPC, "no room")

    monkeypatch.setattr("kv_transfer.transports.shm.require_room", no_room)
    with pytest.raises(OSError, match="no room"):
        HostSegment.create(1 << 20)
    assert set(os.listdir(SHM_DIR)) <= before  # nothing left behind
