"""`pdserve serve` logs its warnings (a role switch, a worker lost) with the time and the
logger, so an operator can line them up with the dashboard; a program that configured logging
itself keeps its own."""

from __future__ import annotations

import re
import subprocess
import sys

SCRIPT = """
import logging, sys
if sys.argv[1] == "configured":
    logging.basicConfig(format="mine: %(message)s")
from router.cli import _log_with_times
_log_with_times()
logging.getLogger("router.rebalancer").warning("rebalancing: a switch")
logging.getLogger("router.rebalancer").info("not shown")
"""


def _stderr(mode: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_warnings_carry_their_time_and_logger() -> None:
    lines = _stderr("plain").splitlines()
    assert len(lines) == 1
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
    assert re.fullmatch(stamp + r" WARNING router\.rebalancer: rebalancing: a switch", lines[0])


def test_a_configured_root_logger_is_left_alone() -> None:
    assert _stderr("configured").splitlines() == ["mine: rebalancing: a switch"]
