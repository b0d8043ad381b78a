"""Pure-CPU parts of the engine and the router import without torch."""

import subprocess
import sys


def _imports_torch(module: str) -> bool:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip() == "True"


def test_scheduler_and_block_manager_do_not_import_torch() -> None:
    assert not _imports_torch("engine.scheduler")
    assert not _imports_torch("engine.kv_cache.block_manager")
    assert not _imports_torch("engine.sampling.params")
    assert not _imports_torch("engine.messages")
    assert not _imports_torch("engine.engine_config")


def test_router_cli_does_not_import_torch() -> None:
    assert not _imports_torch("router.cli")
