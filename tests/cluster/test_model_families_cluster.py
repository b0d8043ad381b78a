"""The model families beyond the dense Llama ones, served disaggregated over HTTP, greedy
completions equal to transformers' tokens:
- DeepSeek-V3 (latent attention and a mixture of experts), its prefill worker of one rank
  handing its latent cache to a decode worker of two (each rank holding half of the heads and
  of every expert's columns, and the whole latent cache); ``/metrics`` shows each worker's
  tokens per expert and its sparse layers' imbalance;
- a sliding-window model (every layer's window shorter than the prompts), whose decode
  worker gives back the blocks that fall out of a sequence's window as it decodes;
- Gemma 3 and gpt-oss, local and global layers in turn (gpt-oss with attention sinks);
- GLM-4.5 (rope on half of each head, DeepSeek-V3's experts) to a decode worker of two ranks."""

from __future__ import annotations

import re
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from engine import LLM, SamplingParams
from router.cluster import Cluster
from router.gateway.auth import ApiKeys
from router.gateway.limits import RequestLimits
from router.gateway.served_model import ServedModel
from router.gateway.server import GatewayServer
from router.gateway.service import Gateway
from tests.cluster.tp_workload import random_prompts
from tests.engine.hf_reference import hf_greedy
from tests.fixtures.local_cluster import local_cluster_config
from tests.fixtures.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(300)

MODEL_NAME = "tiny-model"
API_KEY = "sk-families-0123456789"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def moe_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["DeepseekV3ForCausalLM"]  # a dense first layer, 8 experts after it


@pytest.fixture(scope="module")
def windowed_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    model_dir = make_tiny_model(
        tmp_path_factory.mktemp("windowed"), "MistralForCausalLM", seed=24, sliding_window=20
    )
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, model_dir / item.name)
    return model_dir


def _serve(model_dir: Path, decode_tp: int) -> tuple[Cluster, GatewayServer]:
    cluster = Cluster.start(
        local_cluster_config(model_dir, num_prefill=1, num_decode=1, decode_tp=decode_tp)
    )
    served = ServedModel.load(str(model_dir), MODEL_NAME, None)
    limits = RequestLimits(max_model_len=served.max_model_len)
    gateway = Gateway(cluster, served, limits, ApiKeys((API_KEY,)))
    server = GatewayServer(gateway, "127.0.0.1", 0, 0)
    server.start()
    return cluster, server


@pytest.fixture(scope="module")
def server(ray_session: None, moe_dir: Path) -> Iterator[GatewayServer]:
    cluster, server = _serve(moe_dir, decode_tp=2)
    yield server
    server.stop()
    cluster.shutdown()


def _completions_equal_transformers(server: GatewayServer, model_dir: Path) -> None:
    """The offline engine (one rank) gives transformers' tokens; the cluster's texts are its."""
    prompts = random_prompts(seed=41)[:12]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    offline = LLM(str(model_dir), dtype="float32", device="cpu").generate(prompts, params)
    for prompt, output in zip(prompts, offline, strict=True):
        expected = hf_greedy(model_dir, prompt, MAX_TOKENS)  # up to its eos, if one comes
        assert output.outputs[0].token_ids[: len(expected)] == expected
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key=API_KEY, max_retries=0) as client:
        response = client.completions.create(
            model=MODEL_NAME,
            prompt=prompts,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    choices = sorted(response.choices, key=lambda choice: choice.index)
    assert [choice.text for choice in choices] == [o.outputs[0].text for o in offline]
    assert response.usage is not None and response.usage.completion_tokens == 12 * MAX_TOKENS


def test_a_sliding_window_model_over_http_equals_transformers(
    ray_session: None, windowed_dir: Path
) -> None:
    cluster, server = _serve(windowed_dir, decode_tp=1)
    try:
        _completions_equal_transformers(server, windowed_dir)
    finally:
        server.stop()
        cluster.shutdown()


@pytest.mark.parametrize(
    ("architecture", "decode_tp"),
    [("Gemma3ForCausalLM", 1), ("GptOssForCausalLM", 1), ("Glm4MoeForCausalLM", 2)],
)
def test_more_families_over_http_equal_transformers(
    ray_session: None, model_dirs: dict[str, Path], architecture: str, decode_tp: int
) -> None:
    """Gemma 3 (its local layers' own rope) and gpt-oss (attention sinks, clamped-SwiGLU
    experts), each of sliding and full layers, and GLM-4.5 (rope on half of each head,
    DeepSeek's experts) to a decode worker of two ranks, prefilled on one worker and decoded
    on another."""
    cluster, server = _serve(model_dirs[architecture], decode_tp=decode_tp)
    try:
        _completions_equal_transformers(server, model_dirs[architecture])
    finally:
        server.stop()
        cluster.shutdown()


def test_a_latent_attention_moe_model_over_http_equals_transformers_and_counts_its_experts(
    server: GatewayServer, moe_dir: Path
) -> None:
    _completions_equal_transformers(server, moe_dir)
    # the workers' counts reach /metrics with their next load report
    deadline = time.monotonic() + 60
    while not _every_worker_counted(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _every_worker_counted(server)


def _every_worker_counted(server: GatewayServer) -> bool:
    """Whether /metrics shows tokens on the 8 experts of both workers, and the imbalance of
    the sparse layer (layer 0 is dense)."""
    request = urllib.request.Request(
        server.http_url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    metrics = urllib.request.urlopen(request, timeout=30).read().decode()
    for role in ("prefill", "decode"):
        counted = re.findall(
            rf'pdserve:moe_expert_tokens_total\{{[^}}]*role="{role}"[^}}]*\}} (\S+)', metrics
        )
        if len(counted) != 8 or sum(float(n) for n in counted) == 0:
            return False
        layers = re.findall(
            rf'pdserve:moe_layer_imbalance\{{[^}}]*layer="(\d)"[^}}]*role="{role}"', metrics
        )
        if sorted(layers) != ["1"]:
            return False
    return True
