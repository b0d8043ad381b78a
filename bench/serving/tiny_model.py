"""The serving benchmarks' model: a small random Llama beside the demo tokenizer.

``bench.offline_throughput``'s model (hidden 256, 4 layers, 4 heads of 64, float32, seeded):
small enough that a 2-core machine serves tens of requests a second, with the context (1024
positions) that prompts of 900 tokens need, which the demo model (512) lacks. Both servers of
a comparison load the same directory, so vLLM and pdserve run the same weights and tokenize
the same way.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from engine.demo_model import DEMO_MODEL_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
DEMO_VOCAB_SIZE = 4096  # the demo tokenizer's


# a larger one, for benchmarks where the engines' compute must outweigh the gateway's own work
# on a small CPU machine (29 M parameters: hidden 512, 8 layers, 8 heads of 64)
SMALL_LLAMA = {
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
}

# larger still (101 M parameters: hidden 1024, 8 layers, 16 heads of 64): a decode step's
# compute outweighs the gateway's streaming of its tokens several times over
MEDIUM_LLAMA = {
    "hidden_size": 1024,
    "intermediate_size": 2752,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
}

# a benchmark's --model-size: the config keys each size changes (tiny: none)
MODEL_SIZES: dict[str, dict[str, int] | None] = {
    "tiny": None,
    "small": SMALL_LLAMA,
    "medium": MEDIUM_LLAMA,
}


def add_model_args(parser: argparse.ArgumentParser, default_size: str) -> None:
    """A benchmark's model: ``--model DIR``, or a random Llama of ``--model-size``."""
    parser.add_argument("--model", default=None, help="model dir; default: a random Llama")
    parser.add_argument(
        "--model-size",
        choices=tuple(MODEL_SIZES),
        default=default_size,
        help="the random Llama: tiny (3 M parameters: on a 2-core machine the front door's "
        "work per token weighs as much as its engines'), small (29 M) or medium (101 M: the "
        "engines' compute outweighs the front door's, as on GPUs)",
    )


def build_tiny_llama(
    out_dir: Path,
    max_position_embeddings: int | None = None,
    resize: dict[str, int] | None = None,
) -> Path:
    """Writes the model (safetensors, float32) and the demo tokenizer into ``out_dir``.

    ``max_position_embeddings``: a longer context than the model's 1024 positions (rotary
    positions have no weights, so the weights are the same); None keeps 1024. ``resize``:
    other config keys to change (``SMALL_LLAMA``, ``MEDIUM_LLAMA``)."""
    from bench.offline_throughput import build_model

    out_dir.mkdir(parents=True, exist_ok=True)
    build_model(out_dir, DEMO_VOCAB_SIZE, resize=resize)
    if max_position_embeddings is not None:
        config_path = out_dir / "config.json"
        config = json.loads(config_path.read_text())
        config["max_position_embeddings"] = max_position_embeddings
        config_path.write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(Path(DEMO_MODEL_DIR) / name, out_dir / name)
    return out_dir
