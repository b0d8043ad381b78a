"""vLLM's ``trust_remote_code`` for tokenizers that ship as code in the model directory (Kimi
K2's tiktoken tokenizer): refused without it, naming the flag (never transformers' interactive
question), and run with it by the offline engine, its structured outputs and the gateway
(``pdserve serve --trust-remote-code`` reaching the workers: tests/test_cli.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.structured.spec import StructuredOutputSpec
from engine.tokenizer import load_tokenizer
from router.gateway.served_model import ServedModel

CLASS_NAME = "ShippedTokenizer"
_CODE = f'''from transformers import PreTrainedTokenizerFast


class {CLASS_NAME}(PreTrainedTokenizerFast):
    """The model's own tokenizer class, as Kimi K2 ships its TikTokenTokenizer."""
'''


def _with_shipped_tokenizer(source: Path, target: Path) -> Path:
    """``source`` copied to ``target``, its tokenizer's class code in the directory."""
    shutil.copytree(source, target)
    (target / "tokenization_shipped.py").write_text(_CODE)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = CLASS_NAME
    config["auto_map"] = {"AutoTokenizer": [None, f"tokenization_shipped.{CLASS_NAME}"]}
    config_path.write_text(json.dumps(config))
    return target


@pytest.fixture
def shipped_dir(llama_dir: Path, tmp_path: Path) -> Path:
    # (a directory name of its own: transformers caches the code by it)
    return _with_shipped_tokenizer(llama_dir, tmp_path / f"shipped-{tmp_path.name}")


def test_a_tokenizer_that_ships_as_code_needs_trust_remote_code(shipped_dir: Path) -> None:
    with pytest.raises(ValueError, match="--trust-remote-code"):
        load_tokenizer(shipped_dir)
    assert type(load_tokenizer(shipped_dir, trust_remote_code=True)).__name__ == CLASS_NAME
    with pytest.raises(ValueError, match="--trust-remote-code"):
        ServedModel.load(str(shipped_dir), "tiny", None)
    served = ServedModel.load(str(shipped_dir), "tiny", None, trust_remote_code=True)
    assert type(served.tokenizer).__name__ == CLASS_NAME


def test_the_offline_engine_runs_it_for_text_and_structured_outputs(
    shipped_dir: Path, llama_dir: Path
) -> None:
    with pytest.raises(ValueError, match="--trust-remote-code"):
        LLM(str(shipped_dir), dtype="float32", device="cpu")
    llm = LLM(str(shipped_dir), dtype="float32", device="cpu", trust_remote_code=True)
    assert type(llm.tokenizer).__name__ == CLASS_NAME
    reference = LLM(str(llama_dir), dtype="float32", device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=8)
    assert llm.generate(["Hello"], params)[0].outputs[0].text == (
        reference.generate(["Hello"], params)[0].outputs[0].text
    )
    # the workers' grammars load the tokenizer themselves (LoadConfig.trust_remote_code)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=6, structured_outputs=StructuredOutputSpec(choice=("yes", "no"))
    )
    assert llm.generate(["Hello"], constrained)[0].outputs[0].text in ("yes", "no")
