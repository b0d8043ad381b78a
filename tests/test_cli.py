"""The pdserve command line."""

from __future__ import annotations

import os
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


def test_serve_starts_a_cluster_and_streams_completions(llama_dir: Path) -> None:
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "router.cli",
            "serve",
            "--model",
            str(llama_dir),
            "--prefill",
            "1",
            "--decode",
            "1",
            "--worker-num-cpus",
            "0",
            "--dtype",
            "float32",
            "--block-size",
            "8",
            "--num-kv-blocks",
            "200",
            "--max-tokens",
            "6",
            "--prompt",
            "def main():",
            "--prompt",
            "import os",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cluster up (1 prefill + 1 decode workers" in result.stdout
    assert result.stdout.count(" tokens]") == 2  # one summary line per prompt
    assert "def main():" in result.stdout and "import os" in result.stdout
