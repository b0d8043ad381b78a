"""`pdserve serve --model <a W4A16 checkpoint> --kv-cache-dtype int8`: a prefill and a decode
worker serve it with its weights packed and an 8-bit KV cache whose scales the first worker
calibrated for both, their completions equal the offline engine's (whose tokens equal
transformers': tests/engine/test_packed_int_weights.py, test_quantized_kv_cache.py), and
/v1/models and /metrics say which quantization and KV cache type are served."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from engine import LLM, SamplingParams
from tests.fixtures.quantized_models import make_pack_quantized_model
from tests.fixtures.serve_process import ServeProcess

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["def main():", "import os\nimport sys\n", "class Point:\n    def __init__(self"]
MAX_TOKENS = 8


def test_a_quantized_checkpoint_is_served_end_to_end(tmp_path: Path, tokenizer_dir: Path) -> None:
    model_dir = make_pack_quantized_model(tmp_path, num_bits=4, group_size=32, symmetric=False)
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, model_dir / item.name)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    offline = LLM(str(model_dir), dtype="float32", device="cpu", kv_cache_dtype="int8")
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, params)]
    server = ServeProcess(
        model_dir,
        *("--prefill", "1", "--decode", "1", "--worker-num-cpus", "0", "--dtype", "float32"),
        *("--block-size", "8", "--num-kv-blocks", "200", "--served-model-name", "w4"),
        *("--http-port", "0", "--grpc-port", "0", "--kv-cache-dtype", "int8"),
    )
    try:
        url = server.wait_for_banner()
        body = {
            "model": "w4",
            "prompt": PROMPTS,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        response = httpx.post(url + "/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        choices = sorted(response.json()["choices"], key=lambda choice: choice["index"])
        assert [choice["text"] for choice in choices] == expected
        card = httpx.get(url + "/models", timeout=30).json()["data"][0]
        assert card["quantization"] == "compressed-tensors w4a16 (group 32, asymmetric)"
        assert card["kv_cache_dtype"] == "int8"
        metrics = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=30).text
        assert (
            'pdserve:model_info{kv_cache_dtype="int8",model_name="w4",quantization='
            '"compressed-tensors w4a16 (group 32, asymmetric)"} 1.0' in metrics
        )
    finally:
        server.kill_tree()
