"""While the router's queue of requests waiting for a slow pool is full, the front doors refuse
a new request with 503 and Retry-After before anything starts: a stream gets the status, not a
200 and then an error event."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from engine.messages import TokenEvent
from engine.sampling import SamplingParams
from router.gateway.auth import ApiKeys
from router.gateway.limits import RequestLimits
from router.gateway.served_model import ServedModel
from router.gateway.server import GatewayServer
from router.gateway.service import Gateway
from tests.gateway.one_live_worker import OneLiveWorker

pytestmark = pytest.mark.timeout(120)

DEMO_MODEL = Path(__file__).resolve().parents[2] / "engine" / "demo_model" / "assets"


class QueueingCluster(OneLiveWorker):
    """Answers one token per request; its router queue is full while ``full`` is set."""

    def __init__(self) -> None:
        self.full = False

    def queue_is_full(self) -> bool:
        return self.full

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> AsyncGenerator[TokenEvent, None]:
        yield TokenEvent(request_id or "", 0, 0, 264, None, "length")


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[QueueingCluster, GatewayServer]]:
    model = ServedModel.load(str(DEMO_MODEL), "pdserve-demo", None)
    cluster = QueueingCluster()
    limits = RequestLimits(max_model_len=model.max_model_len)
    server = GatewayServer(Gateway(cluster, model, limits, ApiKeys([])), "127.0.0.1", 0, None)
    server.start()
    yield cluster, server
    server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_full_router_queue_answers_503_with_retry_after_before_any_stream(
    served: tuple[QueueingCluster, GatewayServer], stream: bool
) -> None:
    cluster, server = served
    body = {"model": "pdserve-demo", "prompt": "The os", "max_tokens": 1, "stream": stream}
    with httpx.Client(base_url=server.http_url, timeout=60) as client:
        cluster.full = True
        refused = client.post("/v1/completions", json=body)
        assert refused.status_code == 503, refused.text
        assert "Retry-After" in refused.headers
        assert "queue" in refused.json()["error"]["message"]
        assert client.get("/health").status_code == 200  # full is not unhealthy
        cluster.full = False
        assert client.post("/v1/completions", json=body).status_code == 200
