"""``pdserve serve`` before the HTTP/gRPC front doors: a cluster driven from the terminal.

Prompts come from ``--prompt`` flags (generate, print, exit) or from stdin, one per line;
completions stream back as they are generated.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from typing import Any

from engine.sampling.params import SamplingParams
from router.cluster import Cluster, RequestFailedError
from router.cluster_config import ClusterConfig
from router.detokenizer import IncrementalDetokenizer


async def _complete(cluster: Cluster, tokenizer: Any, prompt: str, params: SamplingParams) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer)
    num_tokens = 0
    print(prompt, end="", flush=True)
    try:
        async for event in cluster.generate(tokenizer.encode(prompt), params):
            num_tokens += 1
            print(detokenizer.push(event.token_id), end="", flush=True)
    except RequestFailedError as error:
        print(f"\n[failed: {error}]", flush=True)
        return
    print(detokenizer.flush(), end="")
    print(f"\n[{num_tokens} tokens]", flush=True)


def serve(
    config: ClusterConfig, prompts: Sequence[str] | None, max_tokens: int, temperature: float
) -> int:
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config.model_dir)
    if tokenizer is None:
        raise ValueError(f"no tokenizer in {config.model_dir}: serve needs one to read prompts")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
    cluster = Cluster.start(config)
    pools = f"{config.num_prefill} prefill + {config.num_decode} decode"
    print(f"pdserve: cluster up ({pools} workers, policy {config.router_policy})", flush=True)
    try:
        lines = prompts if prompts is not None else (line.rstrip("\n") for line in sys.stdin)
        for prompt in lines:
            if prompt:
                asyncio.run(_complete(cluster, tokenizer, prompt, params))
    finally:
        cluster.shutdown()
    return 0
