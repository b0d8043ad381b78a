"""``pdserve serve`` without ``--address`` starts a Ray of its own: it never joins a Ray that
``RAY_ADDRESS`` names or that was started last on the machine (``ray start``, a test's
cluster), which a bare ``ray.init()`` would join."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)

_SCRIPT = """
import ray
from router.local_ray import start_ray, stop_ray
start_ray(None)
print("nodes", len(ray.nodes()), ray.get_runtime_context().gcs_address)
stop_ray()
"""


def test_a_local_ray_is_its_own_whatever_ray_address_says() -> None:
    # nothing listens on port 1: joining it would fail, a Ray of its own starts
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=170
    )
    assert done.returncode == 0, done.stderr[-3000:]
    nodes, address = done.stdout.split()[-2:]
    assert nodes == "1" and not address.endswith(":1")
