"""The planner's costs of gpt-oss in MXFP4: its experts at their 4.25 bits a weight, every other
layer at the model's dtype."""

from __future__ import annotations

import json
from pathlib import Path

from router.planner.model_costs import ModelCosts
from tests.fixtures.tiny_models import tiny_hf_config


def test_gpt_oss_in_mxfp4_costs_its_experts_at_4_25_bits_and_the_rest_float(
    tmp_path: Path,
) -> None:
    raw = tiny_hf_config("GptOssForCausalLM").to_dict()
    (tmp_path / "float").mkdir()
    (tmp_path / "float" / "config.json").write_text(json.dumps(raw))
    raw["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "mxfp4").mkdir()
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(raw))
    bf16, mxfp4 = (ModelCosts.load(tmp_path / name) for name in ("float", "mxfp4"))
    assert mxfp4.routed_expert_bytes == bf16.routed_expert_bytes * 4.25 / 16
    assert mxfp4.weight_bytes - mxfp4.routed_expert_bytes == (
        bf16.weight_bytes - bf16.routed_expert_bytes
    )
    assert mxfp4.weights_stored_as.startswith("mxfp4 experts")
