"""The offline demo behind ``pdserve demo``: a tiny random Llama.

It trains a small byte-level BPE tokenizer on the Python standard library's sources (offline,
deterministic, under a second), writes a Llama config.json beside it, builds random weights with
``load_format="dummy"`` and generates from a few prompts with the offline ``LLM``. The weights
are random, so the text is noise: the demo shows the engine working end to end, not a model.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from engine.demo_model.tokenizer_training import train_bpe_tokenizer

DEMO_PROMPTS = (
    "def fibonacci(n):",
    "import os\nimport sys\n",
    "The quick brown fox",
    "class Scheduler:",
)


def write_demo_model(out_dir: Path, vocab_size: int = 1024) -> Path:
    """Tokenizer plus a Llama config.json (no weights: load with load_format="dummy")."""
    train_bpe_tokenizer(out_dir, vocab_size)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def run_demo(workdir: str | None, max_tokens: int) -> None:
    from engine import LLM, SamplingParams

    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="pdserve-demo-"))
    model_dir = write_demo_model(root)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", load_format="dummy")
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens)
    started = time.perf_counter()
    outputs = llm.generate(list(DEMO_PROMPTS), params)
    seconds = time.perf_counter() - started
    num_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    print(f"pdserve offline demo: tiny random Llama in {model_dir} (random weights: noise text)")
    for output in outputs:
        print(f"\n>>> {output.prompt!r}\n{output.outputs[0].text!r}")
    print(f"\n{num_tokens} tokens in {seconds:.2f} s ({num_tokens / seconds:.0f} tokens/s)")
