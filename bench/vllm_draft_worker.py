"""vLLM's side of ``bench.draft_model --vllm-python`` and ``bench.mtp --vllm-python``, run by
that venv's python as a script (stdlib and vLLM alone: pdserve's packages are not importable
there).

    <vllm-venv>/bin/python bench/vllm_draft_worker.py JOB.json

JOB: {"target", "speculative_config" (vLLM's dict, or null), "batches" (of prompt ids),
"output_len", "repeats", "dtype"}. Prints one line, ``VLLM_RESULT`` and JSON: per batch, the
median seconds of its greedy runs and its tokens.
"""

import json
import statistics
import sys
import time
from pathlib import Path

RESULT = "VLLM_RESULT "


def main(job_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(Path(job_path).read_text())
    target, batches, output_len = job["target"], job["batches"], job["output_len"]
    llm = LLM(
        target,
        dtype=job["dtype"],
        enforce_eager=True,
        max_model_len=512,
        enable_prefix_caching=False,
        speculative_config=job["speculative_config"],
        # prompts are ids; a model built by a bench has no tokenizer
        skip_tokenizer_init=not (Path(target) / "tokenizer_config.json").is_file(),
    )
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    results = []
    for prompts in batches:
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        llm.generate(inputs[::-1], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
        seconds = []
        for _ in range(job["repeats"]):
            started = time.perf_counter()
            outputs = llm.generate(inputs, params)
            seconds.append(time.perf_counter() - started)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        results.append({"median_seconds": statistics.median(seconds), "tokens": tokens})
    print(RESULT + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
