"""kv_transfer depends on torch (and numpy) only; its messages import without torch."""

from __future__ import annotations

import subprocess
import sys


def _modules_after(code: str) -> set[str]:
    script = f"import sys\n{code}\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_messages_and_errors_import_without_torch() -> None:
    loaded = _modules_after(
        "from kv_transfer import TransferTicket, ChannelRendezvous, TransferError, "
        "SUPPORTED_TRANSPORTS"
    )
    assert "torch" not in loaded


def test_channel_imports_neither_engine_nor_ray() -> None:
    loaded = _modules_after("from kv_transfer import KVChannel, make_fake_channel_pair")
    assert "torch" in loaded
    assert not {name.split(".")[0] for name in loaded} & {"engine", "ray", "router"}
