"""While the router's queue of requests waiting for a slow pool is full, the front doors refuse
a new request with 503 and Retry-After before anything starts: a stream gets the status, not a
200 and then an error event."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from router.gateway.served_model import ServedModel
from tests.gateway.token_script import DEMO_MODEL, ScriptedCluster, http_client

pytestmark = pytest.mark.timeout(120)


class QueueingCluster(ScriptedCluster):
    """Answers one token per request; its router queue is full while ``full`` is set."""

    def __init__(self) -> None:
        super().__init__([264])
        self.full = False

    def queue_is_full(self) -> bool:
        return self.full


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[QueueingCluster, httpx.Client]]:
    model = ServedModel.load(str(DEMO_MODEL), "pdserve-demo", None)
    cluster = QueueingCluster()
    with http_client(cluster, model) as client:
        yield cluster, client


@pytest.mark.parametrize("stream", [False, True])
def test_a_full_router_queue_answers_503_with_retry_after_before_any_stream(
    served: tuple[QueueingCluster, httpx.Client], stream: bool
) -> None:
    cluster, client = served
    body = {"model": "pdserve-demo", "prompt": "The os", "max_tokens": 1, "stream": stream}
    cluster.full = True
    refused = client.post("/v1/completions", json=body)
    assert refused.status_code == 503, refused.text
    assert "Retry-After" in refused.headers
    assert "queue" in refused.json()["error"]["message"]
    assert client.get("/health").status_code == 200  # full is not unhealthy
    cluster.full = False
    assert client.post("/v1/completions", json=body).status_code == 200
