"""Writing a benchmark's results: strict JSON with the environment it ran in.

Imports nothing from ``bench.serving`` (whose package pulls in httpx), so any benchmark can
write its JSON on a bare image.
"""

from __future__ import annotations

import json
import math
import platform
import sys
from pathlib import Path
from typing import Any


def jsonable(value: Any) -> Any:
    """``value`` with non-finite floats as strings ("inf", "nan") and tuples as lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # strict JSON has no infinities
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def environment() -> dict[str, str]:
    """The Python version and platform, stored beside every result."""
    return {"python": sys.version.split()[0], "platform": platform.platform()}


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """``payload`` plus the environment, as indented strict JSON (inf is written "inf")."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    document = jsonable({**payload, "environment": environment()})
    path.write_text(json.dumps(document, indent=1, allow_nan=False))
    return path
