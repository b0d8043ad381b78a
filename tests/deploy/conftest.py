"""The deploy/ manifests, parsed once per module."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.deploy.manifests import DEPLOY, load, serve_argv


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    return load(DEPLOY / "cluster.yaml")


@pytest.fixture(scope="module")
def head_serve_argv(cluster: dict[str, Any]) -> list[str]:
    """pdserve's start command: head_setup_commands writes it to ~/pdserve-serve.sh."""
    commands = [c for c in cluster["head_setup_commands"] if "pdserve serve" in c]
    assert len(commands) == 1, "the head has exactly one pdserve start command"
    assert "~/pdserve-serve.sh" in commands[0]
    return serve_argv(commands[0])


@pytest.fixture(scope="module")
def kuberay_documents() -> dict[str, dict[str, Any]]:
    """raycluster.yaml's documents by kind: the RayCluster and the gateway's Service."""
    text = (DEPLOY / "kuberay" / "raycluster.yaml").read_text()
    documents = list(yaml.safe_load_all(text))
    kinds = [document["kind"] for document in documents]
    assert sorted(kinds) == ["RayCluster", "Service"], kinds
    return {document["kind"]: document for document in documents}


@pytest.fixture(scope="module")
def raycluster(kuberay_documents: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return kuberay_documents["RayCluster"]


@pytest.fixture(scope="module")
def gateway_service(kuberay_documents: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return kuberay_documents["Service"]


@pytest.fixture(scope="module")
def head_container(raycluster: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = raycluster["spec"]["headGroupSpec"]["template"]["spec"][
        "containers"
    ][0]
    assert container["name"] == "ray-head"
    return container


@pytest.fixture(scope="module")
def rayjob() -> dict[str, Any]:
    return load(DEPLOY / "kuberay" / "pdserve-rayjob.yaml")
