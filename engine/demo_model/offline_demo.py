"""The offline demo behind ``pdserve demo``: the bundled demo model through the offline ``LLM``.

No Ray and no servers: it loads the trained demo Llama (``DEMO_MODEL_DIR``) in this process,
samples a few continuations of docstring-like prompts and reports the throughput.
"""

from __future__ import annotations

import time

from engine.demo_model import DEMO_MODEL_DIR

DEMO_PROMPTS = (
    "Return the",
    "This module provides",
    "The default value is",
    "Raise ValueError if",
)


def run_demo(max_tokens: int) -> None:
    from engine import LLM, SamplingParams

    llm = LLM(str(DEMO_MODEL_DIR), dtype="float32", device="cpu")
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, seed=0)
    started = time.perf_counter()
    outputs = llm.generate(list(DEMO_PROMPTS), params)
    seconds = time.perf_counter() - started
    num_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    print(f"pdserve offline demo: the bundled demo model ({DEMO_MODEL_DIR})")
    for output in outputs:
        print(f"\n>>> {output.prompt!r}\n{output.outputs[0].text!r}")
    print(f"\n{num_tokens} tokens in {seconds:.2f} s ({num_tokens / seconds:.0f} tokens/s)")
