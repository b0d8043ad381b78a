"""The bundled demo model: a small Llama trained offline on the standard library's docstrings.

``DEMO_MODEL_DIR`` holds the committed weights (bfloat16 safetensors), tokenizer and
``training.json``; ``python -m engine.demo_model.train`` rebuilds them. This package is
torch-free on import: the trainer, the corpus builder and the offline demo live in submodules.
"""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_NAME = "pdserve-demo"
DEMO_MODEL_DIR: Path = Path(__file__).resolve().parent / "assets"

__all__ = ["DEMO_MODEL_DIR", "DEMO_MODEL_NAME"]
