"""The serving benchmarks' model: a small random Llama beside the demo tokenizer.

Hidden 256, 4 layers, 4 heads of 64, float32: small enough that a 2-core machine serves tens
of requests a second, with the context (1024 positions) that prompts of 900 tokens need, which
the demo model (512) lacks. Both servers load the same directory, so vLLM and pdserve run the
same weights and tokenize the same way.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from engine.demo_model import DEMO_MODEL_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_tiny_llama(out_dir: Path, seed: int = 0) -> Path:
    """Writes the model (safetensors, float32) and the demo tokenizer into ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(str(out_dir))
    for name in TOKENIZER_FILES:
        shutil.copy(Path(DEMO_MODEL_DIR) / name, out_dir / name)
    return out_dir
