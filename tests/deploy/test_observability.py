"""The Grafana dashboard and the Prometheus scrape config match what the server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from engine.messages import WorkerCounters, WorkerLoad
from router.cli import build_parser
from router.cluster import SlotRestarts, WorkerStatus
from router.gateway.metrics import GatewayMetrics, SloTargets
from router.kv_aware import PrefixHitStats
from router.latency_model import StepRatios

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
_SUFFIXES = ("_total", "_bucket", "_count", "_sum")


def _exported_families() -> set[str]:
    load = WorkerLoad("decode-0", 1, 2, 3, 0.5, WorkerCounters(num_kv_transfers=1))
    statuses = [WorkerStatus("decode-0", "decode", True, load)]
    restarts = [SlotRestarts("decode-0", "decode", 1)]
    metrics = GatewayMetrics(
        lambda: statuses,
        lambda: {"backlog": 1},
        lambda: restarts,
        SloTargets(),
        prefix_hit_stats=PrefixHitStats,  # (as under kv_aware, the default policy)
        step_prediction_ratios=lambda: {"decode": StepRatios()},
    )
    metrics.first_token(0.1)
    return {f.name for f in text_string_to_metric_families(metrics.render().decode())}


def _base(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def test_every_grafana_query_reads_an_exported_metric() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "pdserve.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(dashboard["panels"]) >= 8 and exprs
    queried = {_base(name) for expr in exprs for name in re.findall(r"pdserve:[a-z0-9_]+", expr)}
    exported = _exported_families()
    assert queried <= exported, queried - exported
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("first token", "inter-token", "goodput", "queue", "batch", "kv", "pool"):
        assert topic in titles


def test_prometheus_scrapes_the_gateway_with_a_key() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["authorization"]["type"] == "Bearer" and job["authorization"]["credentials_file"]
    (target,) = job["static_configs"][0]["targets"]
    default_port = build_parser().parse_args(["serve"]).http_port
    assert target.endswith(f":{default_port}")
