"""Serving benchmark for any OpenAI-compatible endpoint (pdserve, vLLM, ...).

    .venv/bin/python -m bench.serve --base-url http://127.0.0.1:8000/v1 --model NAME \\
        --tokenizer DIR [--workload fixed|uniform|chat-like|shared-prefix] \\
        [--request-rate R | --request-rates 1,2,4] [--result-json PATH] [--plot-dir DIR]

Sends streamed requests at Poisson / gamma arrivals (or all at once under a concurrency
bound), measures TTFT, TPOT, ITL and e2e per request, and reports percentiles, throughput and
goodput under SLOs. See ``bench/serving/`` (``run_benchmark`` / ``sweep`` for scripts) and
``--help``.
"""

from __future__ import annotations

import sys

from bench.serving.cli import main

if __name__ == "__main__":
    sys.exit(main())
