"""``dtype="auto"``: the checkpoint's dtype, but a float16 checkpoint on a CPU runs in bfloat16
where the CPU has native bfloat16 dot products and in float32 where not (float16 has no fast
path on a CPU: engine/cpu_features.py); the gateway reports what the workers run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine import engine_config
from engine.cpu_features import cpu_flags, has_native_bfloat16
from engine.demo_model import DEMO_MODEL_DIR
from engine.engine_config import LoadConfig
from router.gateway.served_model import ServedModel

BF16_CPU = frozenset({"avx2", "avx512f", "avx512_bf16"})
PLAIN_CPU = frozenset({"avx2", "avx512f", "avx512bw"})


@pytest.mark.parametrize(
    ("dtype", "checkpoint", "device", "flags", "expected"),
    [
        ("auto", "float16", "cpu", BF16_CPU, "bfloat16"),
        ("auto", "float16", "cpu", PLAIN_CPU, "float32"),
        ("auto", "float16", "cuda", PLAIN_CPU, "float16"),
        ("auto", "bfloat16", "cpu", PLAIN_CPU, "bfloat16"),
        ("auto", None, "cpu", BF16_CPU, "float32"),
        ("float16", "float16", "cpu", PLAIN_CPU, "float16"),  # asked for: run as asked
        ("fp16", "bfloat16", "cpu", BF16_CPU, "float16"),
    ],
)
def test_auto_runs_a_float16_checkpoint_on_a_cpu_in_what_it_computes_natively(
    dtype: str,
    checkpoint: str | None,
    device: str,
    flags: frozenset[str],
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engine_config, "cpu_flags", lambda: flags)
    assert LoadConfig("some/dir", dtype).dtype_name(checkpoint, device) == expected


def test_the_loaded_model_and_the_gateway_agree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = Path(shutil.copytree(DEMO_MODEL_DIR, tmp_path / "fp16"))
    config = json.loads((model_dir / "config.json").read_text())
    config["dtype"] = "float16"
    (model_dir / "config.json").write_text(json.dumps(config))
    for flags, expected in ((BF16_CPU, torch.bfloat16), (PLAIN_CPU, torch.float32)):
        monkeypatch.setattr(engine_config, "cpu_flags", lambda flags=flags: flags)
        load = LoadConfig(str(model_dir), device="cpu")
        assert load.torch_dtype("float16") == expected
        served = ServedModel.load(str(model_dir), "fp16", None, device="cpu")
        assert served.kv_cache_dtype == str(expected).removeprefix("torch.")


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512_bf16\nbugs\t\t: spectre\n")
    assert cpu_flags(x86) == {"fpu", "sse2", "avx512_bf16"}
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert cpu_flags(arm) == {"fp", "asimd", "bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()
    assert has_native_bfloat16({"amx_bf16"}) and not has_native_bfloat16(PLAIN_CPU)
