"""``bash bench/gpu/lease.sh profile``, the hardware profile a lent GPU's time goes to, run on
this CPU at the tiny shapes (the same script, the device and shapes by its environment): a
broken script would waste device time only a draw gives."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from router.planner.hardware import Hardware

REPO = Path(__file__).resolve().parents[2]


def test_the_lease_profile_target_writes_a_hardware_profile(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "OUT": str(tmp_path),
        "PYTHON": sys.executable,
        "PROFILE_SHAPES": "tiny",
        "PROFILE_DEVICE": "cpu",
    }
    subprocess.run(
        ["bash", "bench/gpu/lease.sh", "profile", "240"],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    hardware = Hardware.load(tmp_path / "hardware_tiny.json")
    assert hardware.measured is not None and hardware.measured.num_samples > 0
    assert hardware.measured_model == "llama-tiny-shapes"
    assert (tmp_path / "llama-tiny-shapes" / "config.json").is_file()
