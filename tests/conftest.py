"""Shared fixtures: tiny random Hugging Face models and a tiny BPE tokenizer, built locally."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.model_config import SUPPORTED_ARCHITECTURES
from tests.fixtures.tiny_models import make_tiny_model
from tests.fixtures.tiny_tokenizer import make_tiny_tokenizer

# Engines built without an explicit KV budget get 64 MiB, not gigabytes, in tests.
os.environ.setdefault("PDSERVE_CPU_KV_CACHE_BYTES", str(64 << 20))

# A local Ray binds every port to 127.0.0.1 with this set (see ENVIRONMENT.md): loopback only.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

# Without a GPU, Triton kernels run in its interpreter on CPU tensors (set before any import
# of triton); on a GPU they compile for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: "
    "{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
ARCHITECTURES = SUPPORTED_ARCHITECTURES  # a tiny model of each: ``model_dirs``


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    """One tiny random model per supported architecture, each with the tiny tokenizer."""
    dirs = {}
    for index, arch in enumerate(ARCHITECTURES):
        model_dir = make_tiny_model(tmp_path_factory.mktemp(arch), arch, seed=index)
        for item in tokenizer_dir.iterdir():
            shutil.copy(item, model_dir / item.name)
        dirs[arch] = model_dir
    return dirs


@pytest.fixture(scope="session")
def llama_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["LlamaForCausalLM"]


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One local Ray for the session's cluster tests; actors there take no CPUs."""
    import ray

    # "local": a Ray of its own, not the test cluster another process may have started here
    # (Ray would join the last one started on the machine)
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        ignore_reinit_error=True,
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def chat_model_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a chat template saved beside its tokenizer."""
    from transformers import AutoTokenizer

    model_dir = tmp_path_factory.mktemp("chat-model") / "tiny-llama"
    shutil.copytree(llama_dir, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(model_dir))
    return model_dir
