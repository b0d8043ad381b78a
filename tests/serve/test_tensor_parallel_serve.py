"""`pdserve serve` with tensor-parallel workers as an operator runs it, on a Ray of its own: a
colocated worker of two ranks, and a prefill and a decode worker of (1, 2), (2, 1) and (2, 2)
ranks, each answering 32 concurrent OpenAI completions exactly as the offline engine of one
rank generates them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from engine import LLM, SamplingParams
from tests.fixtures.serve_process import ServeProcess

pytestmark = pytest.mark.timeout(600)

PROMPTS = [f"def f{i}(x):\n    return x" + " + 1" * (i % 9) + f" * {i}" for i in range(32)]
MAX_TOKENS = 16


async def _complete_all(url: str) -> list[str]:
    """Every prompt's greedy completion text, all sent at once."""

    async def complete(client: httpx.AsyncClient, prompt: str) -> str:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        response = await client.post(url + "/completions", json=body)
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["text"])

    async with httpx.AsyncClient(timeout=120) as client:
        return list(await asyncio.gather(*(complete(client, p) for p in PROMPTS)))


@pytest.mark.parametrize(
    ("layout", "banner"),
    [
        (("-tp", "2", "--prefill", "0"), "1 x TP2 colocated workers"),
        (("--prefill", "1", "--decode", "1", "--decode-tp", "2"), "1 prefill + 1 x TP2 decode"),
        (("--prefill", "1", "--decode", "1", "--prefill-tp", "2"), "1 x TP2 prefill + 1 decode"),
        (("-tp", "2", "--prefill", "1", "--decode", "1"), "1 x TP2 prefill + 1 x TP2 decode"),
    ],
    ids=["colocated-tp2", "P-tp1-D-tp2", "P-tp2-D-tp1", "P-tp2-D-tp2"],
)
def test_serve_with_several_ranks_answers_as_one_rank_generates(
    llama_dir: Path, layout: tuple[str, ...], banner: str
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    llm = LLM(str(llama_dir), dtype="float32", device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    # (a completion cut by max_tokens inside a character ends before its partial bytes, as
    # streamed text does, where a whole decode shows them as U+FFFD)
    outputs = llm.generate(prompts, params)
    expected = [tokenizer.decode(o.outputs[0].token_ids).rstrip("\ufffd") for o in outputs]

    server = ServeProcess(
        llama_dir,
        *layout,
        *("--worker-num-cpus", "0", "--dtype", "float32"),
        *("--served-model-name", "tiny", "--http-port", "0", "--grpc-port", "-1"),
    )
    try:
        url = server.wait_for_banner()
        assert banner in server.output(), server.output()

        assert asyncio.run(_complete_all(url)) == expected
    finally:
        server.kill_tree()


def test_serve_with_experts_dealt_out_whole_answers_as_one_rank_generates(
    model_dirs: dict[str, Path],
) -> None:
    """``--enable-expert-parallel``: a colocated worker of two ranks, each holding four of
    Qwen2-MoE's eight experts, answers 32 concurrent completions as one rank generates them."""
    model_dir = model_dirs["Qwen2MoeForCausalLM"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    llm = LLM(str(model_dir), dtype="float32", device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = llm.generate([tokenizer(p).input_ids for p in PROMPTS], params)
    # (a completion that ends at eos has no eos text: the server skips special tokens)
    expected = [
        tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True).rstrip("\ufffd")
        for o in outputs
    ]
    assert any(o.outputs[0].finish_reason == "stop" for o in outputs)  # some end at eos
    server = ServeProcess(
        model_dir,
        *("-tp", "2", "--prefill", "0", "--enable-expert-parallel"),
        *("--worker-num-cpus", "0", "--dtype", "float32"),
        *("--served-model-name", "tiny", "--http-port", "0", "--grpc-port", "-1"),
    )
    try:
        url = server.wait_for_banner()
        assert "1 x TP2 EP colocated workers" in server.output(), server.output()

        assert asyncio.run(_complete_all(url)) == expected
    finally:
        server.kill_tree()
