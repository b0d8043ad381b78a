"""The built-in dashboard: served from the package (no CDN), and every metric its script reads
is one the server exports."""

from __future__ import annotations

import re
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

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


def _browse(url: str, tmp: Path) -> _BrowserRun:
    """Headless Chromium loads ``url`` and runs its script for 12 s of virtual time."""
    common = [
        _chromium(),
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
    screenshot = tmp / "dashboard.png"
    dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    subprocess.run([*common, f"--screenshot={screenshot}", url], capture_output=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    return _BrowserRun(dom.stdout, dom.stderr, screenshot.read_bytes())


def test_dashboard_renders_live_data_in_a_real_browser(
    gateway_cluster: Cluster, served_model: ServedModel, tmp_path: Path
) -> None:
    """Headless Chromium loads /dashboard during traffic: charts get data, no console errors."""
    _chromium()
    limits = RequestLimits(max_model_len=served_model.max_model_len)
    gateway = Gateway(gateway_cluster, served_model, limits, ApiKeys([]))
    server = GatewayServer(gateway, "127.0.0.1", 0, None)
    server.start()
    stop = threading.Event()

    def traffic() -> None:
        with httpx.Client(base_url=server.http_url, timeout=60) as client:
            while not stop.is_set():
                client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})

    # Four clients of two-token requests: first tokens keep arriving in every window of the
    # page's virtual time, which can run far faster than the real one (with 8-token requests
    # on a loaded machine, a page's whole real lifetime once fell inside the requests' decode
    # steps: inter-token latency had points, time to first token none)
    clients = [threading.Thread(target=traffic, daemon=True) for _ in range(4)]
    for client in clients:
        client.start()
    try:
        run = _browse(server.http_url + "/dashboard", tmp_path)
    finally:
        stop.set()
        for client in clients:
            client.join(timeout=60)
        server.stop()
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


class _ScriptedMetrics(BaseHTTPRequestHandler):
    """Serves the dashboard's files, and a /metrics whose counters grow by the same amount at
    every scrape: 10 requests of one prompt, of which ``backlog`` were prefilled on a decode
    worker because the prefill pool was backed up (and 5 short prompts, which say nothing about
    the pool); and ``refused`` requests refused with 429 and as many with 401, which place no
    prompt."""

    backlog = 0
    refused = 0
    scrapes = 0

    def do_GET(self) -> None:  # noqa: N802 (the http.server hook's name)
        if self.path == "/metrics":
            type(self).scrapes += 1
            n = type(self).scrapes
            body = (
                'pdserve:worker_alive{role="prefill",worker="prefill-0"} 1\n'
                'pdserve:worker_alive{role="decode",worker="decode-0"} 1\n'
                f'pdserve:requests_total{{status="ok"}} {10 * n}\n'
                f'pdserve:requests_total{{status="rejected"}} {self.refused * n}\n'
                f'pdserve:requests_total{{status="unauthorized"}} {self.refused * n}\n'
                f"pdserve:prompts_total {10 * n}\n"
                f'pdserve:local_prefills_total{{reason="backlog"}} {self.backlog * n}\n'
                f'pdserve:local_prefills_total{{reason="short"}} {5 * n}\n'
            ).encode()
            media_type = "text/plain"
        else:
            name = self.path.removeprefix("/dashboard").lstrip("/") or "index.html"
            body, media_type = asset(name), ASSETS[name]
        self.send_response(200)
        self.send_header("Content-Type", media_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.parametrize(
    ("backlog", "refused", "advised"), [(3, 0, True), (3, 100, True), (0, 0, False)]
)
def test_dashboard_advises_prefill_workers_while_decode_workers_absorb_a_backlog(
    tmp_path: Path, backlog: int, refused: int, advised: bool
) -> None:
    """30% of the prompts prefilled on decode workers for want of prefill capacity: the page
    names the prefill pool as the one to grow. Short prompts prefilled there do not count, nor
    do refused requests, which place no prompt: the share is of the prompts sent. (It was of
    requests of every status, so under overload, 429s outnumbering the rest hid the advice.)"""
    _chromium()
    attributes = {"backlog": backlog, "refused": refused, "scrapes": 0}
    handler = type("Handler", (_ScriptedMetrics,), attributes)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        run = _browse(f"http://127.0.0.1:{server.server_address[1]}/dashboard", tmp_path)
    finally:
        server.shutdown()
    advice = re.search(r'<section id="advice".*?</section>', run.dom, re.S)
    assert advice is not None, run.dom[-2000:]
    expected = "Decode workers prefilled 30% of the prompts over the last 30 s because the prefill"
    assert (expected in advice.group(0)) is advised, advice.group(0)
    assert ("add prefill workers" in advice.group(0)) is advised


def _in_node(scrapes: list[str], tmp: Path) -> dict[str, Any]:
    """What the page shows after polling ``scrapes`` (one /metrics body per poll), its script
    run in Node (``dashboard_harness.js``: a stand-in DOM; no browser needed)."""
    import json
    import shutil

    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.skip("needs Node.js for the dashboard script test")
    script = tmp / "dashboard.js"
    script.write_bytes(asset("dashboard.js"))
    (tmp / "scrapes.json").write_text(json.dumps(scrapes))
    harness = Path(__file__).with_name("dashboard_harness.js")
    run = subprocess.run(
        [node, str(harness), str(script), str(tmp / "scrapes.json")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    shown: dict[str, Any] = json.loads(run.stdout)
    return shown


def test_dashboard_shows_restarts_and_names_the_slots_restarted_lately(tmp_path: Path) -> None:
    """decode-0 was restarted once before the page opened and once while it is open: the
    header counts both; the advice names decode-0 for the one it saw. prefill-0 never was."""

    def body(decode_restarts: int) -> str:
        return (
            'pdserve:worker_alive{role="prefill",worker="prefill-0"} 1\n'
            'pdserve:worker_alive{role="decode",worker="decode-0-r2"} 1\n'
            f'pdserve:worker_restarts_total{{role="decode",slot="decode-0"}} {decode_restarts}\n'
            'pdserve:worker_restarts_total{role="prefill",slot="prefill-0"} 0\n'
        )

    shown = _in_node([body(1)] * 3 + [body(2)] * 3, tmp_path)
    assert shown["pools"] == "pools: 1 prefill · 1 decode · 2 worker restarts since start"
    assert "Workers restarted in the last 2 min: decode-0 (1):" in shown["advice"]
    assert "prefill-0" not in shown["advice"]
    quiet = _in_node([body(1)] * 6, tmp_path)  # restarted before the page opened only
    assert quiet["pools"] == "pools: 1 prefill · 1 decode · 1 worker restart since start"
    assert quiet["advice"] == "Within SLOs (p90 over the last 30 s)."


def test_dashboard_draws_draft_acceptance_for_workers_that_speculate(tmp_path: Path) -> None:
    """A line per worker whose draft tokens grow (decode-0 here); none for a worker that
    checks no drafts (prefill-0), so a cluster without --speculative-config draws none."""

    def body(n: int, drafts_per_scrape: int) -> str:
        return (
            'pdserve:worker_alive{role="prefill",worker="prefill-0"} 1\n'
            'pdserve:worker_alive{role="decode",worker="decode-0"} 1\n'
            'pdserve:spec_decode_num_draft_tokens_total{role="prefill",worker="prefill-0"} 0\n'
            'pdserve:spec_decode_num_accepted_tokens_total{role="prefill",worker="prefill-0"} 0\n'
            "pdserve:spec_decode_num_draft_tokens_total"
            f'{{role="decode",worker="decode-0"}} {drafts_per_scrape * n}\n'
            "pdserve:spec_decode_num_accepted_tokens_total"
            f'{{role="decode",worker="decode-0"}} {drafts_per_scrape // 2 * n}\n'
        )

    speculating = _in_node([body(n, 10) for n in range(1, 5)], tmp_path)
    assert speculating["points"]["spec"] == 3  # one per scrape after the first
    assert _in_node([body(n, 0) for n in range(1, 5)], tmp_path)["points"]["spec"] == 0
