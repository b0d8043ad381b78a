"""The built-in dashboard: served from the package (no CDN), and every metric its script reads
is one the server exports."""

from __future__ import annotations

import re
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.cluster import Cluster
from router.gateway.auth import ApiKeys
from router.gateway.dashboard import ASSETS, DASHBOARD_METRICS, asset
from router.gateway.limits import RequestLimits
from router.gateway.served_model import ServedModel
from router.gateway.server import GatewayServer
from router.gateway.service import Gateway
from router.local_prefill import LocalPrefillRule
from tests.gateway.conftest import API_KEYS, MODEL_NAME

AUTH = {"Authorization": f"Bearer {API_KEYS[0]}"}
_SUFFIXES = ("_total", "_bucket", "_count", "_sum")


@pytest.fixture(scope="module")
def http(gateway_server: GatewayServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway_server.http_url, timeout=60) as client:
        yield client


def _base_name(sample: str) -> str:
    for suffix in _SUFFIXES:
        if sample.endswith(suffix):
            return sample[: -len(suffix)]
    return sample


def test_page_and_assets_are_served_locally(http: httpx.Client) -> None:
    page = http.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    linked = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert linked and all(link.startswith("/dashboard/") for link in linked)  # nothing remote
    for link in linked:
        response = http.get(link)
        assert response.status_code == 200
        assert response.content == asset(link.removeprefix("/dashboard/"))
    for name in ASSETS:
        assert "http://" not in asset(name).decode() and "https://" not in asset(name).decode()
    assert http.get("/dashboard/secret.py").status_code == 404
    assert http.get("/dashboard/..%2Fserver.py").status_code == 404


def test_the_script_reads_only_exported_metrics(http: httpx.Client) -> None:
    script = asset("dashboard.js").decode()
    read = {_base_name(name) for name in re.findall(r'"(pdserve:[a-z0-9_]+)"', script)}
    assert read == set(DASHBOARD_METRICS)
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3}
    assert http.post("/v1/completions", json=body, headers=AUTH).status_code == 200
    exported = {
        family.name
        for family in text_string_to_metric_families(http.get("/metrics", headers=AUTH).text)
    }
    assert set(DASHBOARD_METRICS) <= exported


def _chromium() -> str:
    import shutil

    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("needs Debian's chromium (apt-get install chromium) for the browser test")
    return path


@dataclass
class _BrowserRun:
    dom: str  # the page's DOM after the virtual time budget
    log: str  # Chromium's stderr (console messages)
    screenshot: bytes


def _browse_during_traffic(cluster: Cluster, served_model: ServedModel, tmp: Path) -> _BrowserRun:
    """Headless Chromium loads /dashboard of a gateway over ``cluster`` while requests flow."""
    chromium = _chromium()
    limits = RequestLimits(max_model_len=served_model.max_model_len)
    server = GatewayServer(
        Gateway(cluster, served_model, limits, ApiKeys([])), "127.0.0.1", 0, None
    )
    server.start()
    stop = threading.Event()

    def traffic() -> None:
        with httpx.Client(base_url=server.http_url, timeout=60) as client:
            while not stop.is_set():
                client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8})

    load = threading.Thread(target=traffic, daemon=True)
    load.start()
    screenshot = tmp / "dashboard.png"
    try:
        common = [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--window-size=1400,1400",
            "--virtual-time-budget=12000",
            "--enable-logging=stderr",
            "--v=0",
        ]
        dom = subprocess.run(
            [*common, "--dump-dom", server.http_url + "/dashboard"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        subprocess.run(
            [*common, f"--screenshot={screenshot}", server.http_url + "/dashboard"],
            capture_output=True,
            timeout=120,
        )
    finally:
        stop.set()
        load.join(timeout=60)
        server.stop()
    assert dom.returncode == 0, dom.stderr[-2000:]
    return _BrowserRun(dom.stdout, dom.stderr, screenshot.read_bytes())


def test_dashboard_renders_live_data_in_a_real_browser(
    gateway_cluster: Cluster, served_model: ServedModel, tmp_path: Path
) -> None:
    """Headless Chromium loads /dashboard during traffic: charts get data, no console errors."""
    run = _browse_during_traffic(gateway_cluster, served_model, tmp_path)
    points = dict(re.findall(r'<canvas id="(\w+)"[^>]*data-points="(\d+)"', run.dom))
    for chart in ("ttft", "itl", "throughput", "waiting", "running", "kv", "prefill"):
        assert int(points.get(chart, 0)) > 0, (chart, points)
    assert "updated" in run.dom and "pools: 1 prefill · 1 decode" in run.dom
    assert "add prefill workers" not in run.dom  # the prefill pool computes every prompt
    console_errors = [
        line for line in run.log.splitlines() if "CONSOLE" in line and "ERROR" in line.upper()
    ]
    assert not console_errors, console_errors
    assert len(run.screenshot) > 10_000
    artifacts = Path(__file__).resolve().parents[2] / "tests" / "artifacts"
    artifacts.mkdir(exist_ok=True)
    (artifacts / "dashboard.png").write_bytes(run.screenshot)


def test_dashboard_advises_prefill_workers_when_the_decode_pool_prefills(
    gateway_cluster: Cluster, served_model: ServedModel, tmp_path: Path
) -> None:
    """While the decode worker prefills the prompts itself (here: every prompt is short enough
    for it), the page names the prefill pool as the one to grow."""
    config = gateway_cluster.config
    gateway_cluster.config = replace(config, local_prefill=LocalPrefillRule(10**6))
    try:
        run = _browse_during_traffic(gateway_cluster, served_model, tmp_path)
    finally:
        gateway_cluster.config = config
    advice = re.search(r'<section id="advice".*?</section>', run.dom, re.S)
    assert advice is not None
    assert "The decode pool prefilled 100% of prompt tokens" in advice.group(0)
    assert "add prefill workers" in advice.group(0)
