"""The operator dashboard at ``/dashboard``: a static page, a script and a stylesheet, served from
this package (no CDN: clusters are often air-gapped).

The page holds no data: its script polls ``/metrics`` (which needs the API key; the page asks
for it once and keeps it in the tab's sessionStorage), keeps ten minutes of history in memory,
and draws the charts on canvases. ``DASHBOARD_METRICS`` lists every metric the script reads;
a test checks that the server exports each of them.
"""

from __future__ import annotations

from importlib import resources

ASSETS = {  # file -> media type; nothing else under /dashboard is served
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
DASHBOARD_METRICS = (
    "pdserve:time_to_first_token_seconds",
    "pdserve:inter_token_latency_seconds",
    "pdserve:slo_target_seconds",
    "pdserve:generation_tokens",
    "pdserve:requests",
    "pdserve:prompts",
    "pdserve:slo_met",
    "pdserve:num_requests_waiting",
    "pdserve:num_requests_running",
    "pdserve:kv_cache_usage_perc",
    "pdserve:kv_transfer_bytes",
    "pdserve:worker_prefill_tokens",
    "pdserve:local_prefills",
    "pdserve:worker_alive",
    "pdserve:worker_restarts",
    "pdserve:spec_decode_num_draft_tokens",
    "pdserve:spec_decode_num_accepted_tokens",
    "pdserve:time_per_output_token_seconds",
    "pdserve:predicted_time_to_first_token_seconds",
    "pdserve:predicted_time_per_output_token_seconds",
    "pdserve:admission_refusals",
    "pdserve:role_switches",
)


def asset(name: str) -> bytes:
    """The bytes of one dashboard file (KeyError for anything not in ``ASSETS``)."""
    if name not in ASSETS:
        raise KeyError(name)
    return resources.files(__package__).joinpath(name).read_bytes()
