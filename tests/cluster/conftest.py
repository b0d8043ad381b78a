"""A local Ray for cluster tests: loopback only, actors take no CPUs."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Ray binds every port to 127.0.0.1 with this set (see ENVIRONMENT.md); tests stay on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()
