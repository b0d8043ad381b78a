"""The pdserve command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _pdserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "router.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_prints_a_completion(llama_dir: Path) -> None:
    result = _pdserve(
        "generate",
        "--model",
        str(llama_dir),
        "--prompt",
        "def main():",
        "--max-tokens",
        "5",
        "--dtype",
        "float32",
        "--device",
        "cpu",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def main():")
    assert "5 tokens]" in result.stdout or "[stop;" in result.stdout


def test_generate_reports_bad_input_by_field(llama_dir: Path) -> None:
    result = _pdserve(
        "generate", "--model", str(llama_dir), "--prompt", "x", "--top-p", "2", "--device", "cpu"
    )
    assert result.returncode == 2
    assert "top_p" in result.stderr


def test_unknown_architecture_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    result = _pdserve("generate", "--model", str(tmp_path), "--prompt", "x", "--device", "cpu")
    assert result.returncode == 2
    assert "LlamaForCausalLM" in result.stderr


def test_demo_runs(tmp_path: Path) -> None:
    result = _pdserve("demo", "--workdir", str(tmp_path), "--max-tokens", "4")
    assert result.returncode == 0, result.stderr
    assert "tokens/s" in result.stdout
