"""A running gateway (HTTP + gRPC) over a 1 prefill + 1 decode cluster on the tiny Llama."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from router.cluster import Cluster
from router.gateway.auth import ApiKeys
from router.gateway.limits import RequestLimits
from router.gateway.served_model import ServedModel
from router.gateway.server import GatewayServer
from router.gateway.service import Gateway
from tests.fixtures.local_cluster import local_cluster_config

API_KEYS = ("sk-alice-0123456789", "sk-bob-9876543210")
MODEL_NAME = "tiny-llama"
LIMITS = {"max_body_bytes": 64 * 1024, "max_n": 4, "max_stop_strings": 4, "max_messages": 8}


@pytest.fixture(scope="session")
def gateway_cluster(ray_session: None, chat_model_dir: Path) -> Iterator[Cluster]:
    cluster = Cluster.start(local_cluster_config(chat_model_dir))
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="session")
def served_model(chat_model_dir: Path) -> ServedModel:
    return ServedModel.load(str(chat_model_dir), MODEL_NAME, None)


@pytest.fixture(scope="session")
def gateway_server(gateway_cluster: Cluster, served_model: ServedModel) -> Iterator[GatewayServer]:
    limits = RequestLimits(max_model_len=served_model.max_model_len, **LIMITS)
    gateway = Gateway(gateway_cluster, served_model, limits, ApiKeys(API_KEYS))
    server = GatewayServer(gateway, "127.0.0.1", 0, 0)
    server.start()
    yield server
    server.stop()
