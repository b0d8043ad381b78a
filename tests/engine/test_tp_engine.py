"""The offline LLM over tensor-parallel ranks: its follower processes' lives and failures.

A worker's configs are checked before any process starts; followers stop on close(), when
the LLM is garbage, when the interpreter exits, and when rank 0's process is killed; a
follower killed mid-life fails rank 0's next step, naming it, within the deadline. (Token
parity under tensor parallelism is tests/engine/test_tp_parity.py's.)
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.engine_config import CacheConfig, LoadConfig
from engine.kv_cache.budget import KVBudget
from engine.parallel.group import TensorParallelGroup
from engine.parallel.rank_model import build_rank_model
from engine.scheduler import SchedulerConfig
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_parity import make_prompts
from tests.engine.tp_ranks import RankPool

REPO_ROOT = Path(__file__).resolve().parents[2]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
EXIT_WAIT_S = 15.0  # how long a follower may take to notice its worker is gone


def process_running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until_gone(pids: list[int], timeout_s: float = EXIT_WAIT_S) -> list[int]:
    """The pids still running after up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    running = [pid for pid in pids if process_running(pid)]
    while running and time.monotonic() < deadline:
        time.sleep(0.05)
        running = [pid for pid in running if process_running(pid)]
    return running


def tp2(model_dir: Path, **options: object) -> LLM:
    return LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        skip_tokenizer_init=True,
        tensor_parallel_size=2,
        **options,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("size", "message"),
    [
        (0, "tensor_parallel_size must be an int >= 1, got 0"),
        (3, "tensor_parallel_size 3 must divide num_attention_heads 4"),
        (8, "tensor_parallel_size 8 must divide num_attention_heads 4"),
    ],
)
def test_a_bad_size_names_the_field_before_any_process_starts(
    llama_dir: Path, size: int, message: str
) -> None:
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=message):
        LLM(str(llama_dir), dtype="float32", device="cpu", tensor_parallel_size=size)
    assert set(multiprocessing.active_children()) == before


def built_rank(group: TensorParallelGroup, model_dir: str) -> tuple[int, int, int]:
    """(KV heads, KV blocks, KV blocks its own budget holds) of this rank's build."""
    memory_bytes = (64 << 10) * (1 + group.rank)  # rank r: r + 1 times rank 0's
    budget = KVBudget(memory_bytes=memory_bytes)
    load = LoadConfig(model_dir, "float32", "cpu")
    built = build_rank_model(load, CacheConfig(8, budget=budget), SchedulerConfig(), None, group)
    if built.num_threads_before is not None:
        torch.set_num_threads(built.num_threads_before)
    bytes_per_block = built.kv_cache[:, :, 0].numel() * built.kv_cache.element_size()
    return built.shard.num_kv_heads, built.num_kv_blocks, memory_bytes // bytes_per_block


def test_every_rank_holds_its_kv_heads_in_as_many_blocks_as_the_least_rank(
    llama_dir: Path,
) -> None:
    pool = RankPool(1)
    try:
        ranks = pool.run(built_rank, str(llama_dir), size=2)
    finally:
        pool.close()
    # 2 layers x K and V x 8 tokens x 1 head x 16 dims x 4 bytes = 2 KiB a block
    assert ranks == [(1, 32, 32), (1, 32, 64)]


def test_followers_stop_on_close_and_when_the_llm_is_garbage(llama_dir: Path) -> None:
    prompt = make_prompts(seed=4)[3]
    num_threads = torch.get_num_threads()
    llm = tp2(llama_dir)
    (pid,) = llm.follower_pids
    assert process_running(pid)
    assert llm.engine.kv_cache.shape[4] == 1  # rank 0 holds 1 of the 2 KV heads
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))
    assert out.outputs[0].token_ids == hf_greedy(llama_dir, prompt, 8)
    llm.close()
    assert wait_until_gone([pid], timeout_s=0.0) == []  # close() waited for it
    assert torch.get_num_threads() == num_threads  # given back
    llm.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([prompt], SamplingParams(max_tokens=1))

    # speculative decoding: the drafts' logits are the followers' too
    llm = tp2(llama_dir, speculative_config=NGRAM)
    (pid,) = llm.follower_pids
    repeating = [5, 6, 7, 8, 9] * 8
    (out,) = llm.generate([repeating], SamplingParams(temperature=0.0, max_tokens=12))
    assert out.outputs[0].token_ids == hf_greedy(llama_dir, repeating, 12)
    assert llm.engine.stats.num_draft_tokens > 0
    del llm, out
    gc.collect()
    assert wait_until_gone([pid], timeout_s=0.0) == []


def test_a_killed_follower_fails_the_next_step_within_the_deadline(llama_dir: Path) -> None:
    timeout_s = 10.0
    llm = tp2(llama_dir, tensor_parallel_timeout_s=timeout_s)
    prompt = make_prompts(seed=4)[2]
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))
    (pid,) = llm.follower_pids
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"rank 1 \(pid {pid}\) exited with code -9"):
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))
    assert time.monotonic() - started < timeout_s + 5.0
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(RuntimeError, match="cannot step"):  # at once: the ranks are gone
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))
    llm.close()


_SCRIPT = """
import os, sys, time
from engine import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], device="cpu", skip_tokenizer_init=True, tensor_parallel_size=2)
    print(*llm.follower_pids, flush=True)
    if sys.argv[2] == "wait":
        time.sleep(600)
"""


@pytest.mark.parametrize("ending", ["exit", "wait"])
def test_no_follower_outlives_its_interpreter(llama_dir: Path, ending: str) -> None:
    """``exit``: the interpreter ends without close(); ``wait``: it is killed (SIGKILL)."""
    script = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, str(llama_dir), ending],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert script.stdout is not None
        pids = [int(pid) for pid in script.stdout.readline().split()]
        assert len(pids) == 1 and process_running(pids[0])
        if ending == "wait":
            script.kill()
        assert script.wait(timeout=60) == (0 if ending == "exit" else -signal.SIGKILL)
        assert wait_until_gone(pids) == []
    finally:
        script.kill()
        script.wait()
