"""`pdserve serve -tp 2` as an operator runs it: one colocated worker of two ranks on a Ray of
its own, answering concurrent OpenAI completions exactly as the offline engine of one rank
generates them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from engine import LLM, SamplingParams
from tests.fixtures.serve_process import ServeProcess

pytestmark = pytest.mark.timeout(600)

PROMPTS = [f"def f{i}(x):\n    return x" + " + 1" * i for i in range(8)]
MAX_TOKENS = 16


def test_serve_with_two_ranks_answers_as_one_rank_generates(llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    llm = LLM(str(llama_dir), dtype="float32", device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    expected = [tokenizer.decode(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]

    server = ServeProcess(
        llama_dir,
        *("-tp", "2", "--prefill", "0", "--worker-num-cpus", "0", "--dtype", "float32"),
        *("--served-model-name", "tiny", "--http-port", "0", "--grpc-port", "-1"),
    )
    try:
        url = server.wait_for_banner()
        assert "1 x TP2 colocated workers" in server.output(), server.output()

        async def complete(client: httpx.AsyncClient, prompt: str) -> str:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            response = await client.post(url + "/completions", json=body)
            assert response.status_code == 200, response.text
            return str(response.json()["choices"][0]["text"])

        async def complete_all() -> list[str]:
            async with httpx.AsyncClient(timeout=120) as client:
                return list(await asyncio.gather(*(complete(client, p) for p in PROMPTS)))

        assert asyncio.run(complete_all()) == expected
    finally:
        server.kill_tree()
