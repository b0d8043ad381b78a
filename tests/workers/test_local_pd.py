"""Prefill and decode workers in one process, KV over a real gloo channel on loopback."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from decode_worker.worker import DecodeWorker
from engine import LLM, GenerateRequest, SamplingParams
from engine.engine_config import CacheConfig, LoadConfig
from engine.kv_cache.budget import KVBudget
from engine.kv_cache.kv_quantization import KVCacheScales
from engine.messages import (
    CancelReservation,
    HandoffCall,
    JoinChannel,
    ReceiveKV,
    ReserveBlocks,
)
from engine.scheduler import SchedulerConfig
from kv_transfer import KVChannel, TransferTicket
from kv_transfer.policy import FailurePolicy, TransferConfig
from prefill_worker.worker import PrefillWorker
from tests.engine.hf_reference import hf_greedy
from tests.engine.quantized_kv_reference import transformers_quantized_kv_greedy
from tests.engine.test_parity import make_prompts
from tests.workers.local_peer import LocalDecodePeer, answered
from tests.workers.output_collector import OutputCollector

GATEWAY = "test-gateway"
T = TypeVar("T")


def _load(model_dir: Path) -> LoadConfig:
    return LoadConfig(str(model_dir), dtype="float32", device="cpu")


def _cache(block_size: int = 8, num_blocks: int = 400) -> CacheConfig:
    return CacheConfig(block_size=block_size, budget=KVBudget(num_blocks=num_blocks))


def _workload(num_requests: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompt_sets = [make_prompts(seed=s) for s in (21, 22, 23, 24)]
    prompts = list(itertools.islice(itertools.chain(*prompt_sets), num_requests))
    params = [
        SamplingParams(temperature=0.0, max_tokens=4 + (7 * i) % 29) for i in range(num_requests)
    ]
    return prompts, params


@dataclass
class Cluster:
    prefills: list[PrefillWorker]
    decodes: list[DecodeWorker]
    collector: OutputCollector

    def shutdown(self) -> None:
        self.collector.close()
        for worker in [*self.prefills, *self.decodes]:
            worker.shutdown()


def _cluster(
    model_dir: Path, num_prefill: int, num_decode: int, transfer: TransferConfig, **sched: int
) -> Cluster:
    scheduler = SchedulerConfig(**sched)  # type: ignore[arg-type]
    decodes = [
        DecodeWorker(f"d{i}", _load(model_dir), _cache(), scheduler, transfer)
        for i in range(num_decode)
    ]
    peers = {d.worker_id: LocalDecodePeer(d) for d in decodes}
    prefills = [
        PrefillWorker(f"p{i}", _load(model_dir), _cache(), scheduler, transfer, peers)
        for i in range(num_prefill)
    ]
    sources = [w.next_batch for w in [*prefills, *decodes]]
    return Cluster(prefills, decodes, OutputCollector(sources, GATEWAY))


@pytest.fixture
def offline(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8)


@pytest.fixture
def cluster_factory(llama_dir: Path) -> Iterator:  # type: ignore[type-arg]
    made: list[Cluster] = []

    def make(
        num_prefill: int,
        num_decode: int,
        transport: str = "gloo",
        max_channels: int = 8,
        transfer: TransferConfig | None = None,
        **kwargs: object,
    ) -> Cluster:
        if transfer is None:
            transfer = TransferConfig(
                transport=transport, timeout_s=10.0, max_channels=max_channels
            )
        made.append(_cluster(llama_dir, num_prefill, num_decode, transfer, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for cluster in made:
        cluster.shutdown()


@pytest.mark.parametrize(
    ("num_prefill", "num_decode", "transport"), [(1, 1, "gloo"), (2, 2, "gloo"), (1, 1, "shm")]
)
def test_split_cluster_matches_offline_engine(
    cluster_factory,  # type: ignore[no-untyped-def]
    offline: LLM,
    num_prefill: int,
    num_decode: int,
    transport: str,
) -> None:
    prompts, params = _workload(32)
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, params)]
    cluster = cluster_factory(num_prefill, num_decode, transport, max_num_batched_tokens=128)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        prefill = cluster.prefills[i % num_prefill]
        decode_id = cluster.decodes[i % num_decode].worker_id
        prefill.submit(GenerateRequest(f"r{i}", prompt, p, GATEWAY), decode_id)
    cluster.collector.wait_finished([(f"r{i}", 0) for i in range(32)])
    assert not cluster.collector.failures
    assert [cluster.collector.output(f"r{i}") for i in range(32)] == expected
    assert cluster.collector.num_duplicates == 0
    for worker in [*cluster.prefills, *cluster.decodes]:
        assert worker.load().kv_usage == 0.0  # leases released, every request finished


def test_idle_channels_close_beyond_the_cap_and_reopen(cluster_factory, offline: LLM) -> None:  # type: ignore[no-untyped-def]
    prompts, params = _workload(12)
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, params)]
    cluster = cluster_factory(1, 2, "gloo", 1, max_num_batched_tokens=64)
    (prefill,) = cluster.prefills
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        decode_id = cluster.decodes[i % 2].worker_id
        prefill.submit(GenerateRequest(f"c{i}", prompt, p, GATEWAY), decode_id)
        cluster.collector.wait_finished([(f"c{i}", 0)])  # one at a time: channels alternate
    assert [cluster.collector.output(f"c{i}") for i in range(12)] == expected
    assert len(prefill.channels) == 1


def test_a_forgotten_decode_worker_gets_no_request_and_its_channel_is_closed(
    cluster_factory,  # type: ignore[no-untyped-def]
    offline: LLM,
) -> None:
    """The router tells the prefill workers when a decode worker's process is gone: before,
    its channel stayed open (an NCCL one holding GPU memory) until the cap closed it."""
    prompts, params = _workload(2)
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, params)]
    cluster = cluster_factory(1, 2, "gloo")
    (prefill,) = cluster.prefills
    prefill.submit(GenerateRequest("f0", prompts[0], params[0], GATEWAY), "d0")
    cluster.collector.wait_finished([("f0", 0)])
    (channel,) = [channel for worker_id, channel in prefill.channels.items() if worker_id == "d0"]
    prefill.forget_decode_peer("d0")
    assert "d0" not in prefill.channels and channel.broken  # closed
    with pytest.raises(ValueError, match="unknown decode worker 'd0'"):
        prefill.submit(GenerateRequest("f1", prompts[1], params[1], GATEWAY), "d0")
    prefill.submit(GenerateRequest("f1", prompts[1], params[1], GATEWAY), "d1")
    cluster.collector.wait_finished([("f1", 0)])
    assert [cluster.collector.output(f"f{i}") for i in range(2)] == expected


def test_a_channel_opened_past_the_cap_while_the_others_are_busy_is_used(
    cluster_factory,  # type: ignore[no-untyped-def]
    offline: LLM,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cap 1: while the channel to d0 carries a slow transfer, a hand-off to d1 opens a second
    channel. The cap closes idle channels only, so that one stays open for its hand-off (it
    was closed the moment it opened, and the hand-off failed with a KeyError)."""
    prompts, params = _workload(2)
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, params)]
    cluster = cluster_factory(1, 2, "gloo", 1, max_num_batched_tokens=64)
    (prefill,) = cluster.prefills
    slow_decode = cluster.decodes[0]
    receive = slow_decode._recv

    def slow_receive(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(1.0)  # keeps the channel to d0 in use
        return receive(*args, **kwargs)

    monkeypatch.setattr(slow_decode, "_recv", slow_receive)
    prefill.submit(GenerateRequest("busy", prompts[0], params[0], GATEWAY), "d0")
    time.sleep(0.3)
    prefill.submit(GenerateRequest("other", prompts[1], params[1], GATEWAY), "d1")
    cluster.collector.wait_finished([("busy", 0), ("other", 0)])
    assert not cluster.collector.failures
    assert [cluster.collector.output(rid) for rid in ("busy", "other")] == expected


def test_colocated_decode_worker_matches_offline_engine(cluster_factory, offline: LLM) -> None:  # type: ignore[no-untyped-def]
    prompts, params = _workload(12)
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, params)]
    cluster = cluster_factory(0, 1, max_num_batched_tokens=64)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        cluster.decodes[0].submit(GenerateRequest(f"c{i}", prompt, p, GATEWAY))
    cluster.collector.wait_finished([(f"c{i}", 0) for i in range(12)])
    assert [cluster.collector.output(f"c{i}") for i in range(12)] == expected


def test_split_workers_honour_logit_bias_and_allowed_token_ids(
    cluster_factory,  # type: ignore[no-untyped-def]
    offline: LLM,
) -> None:
    """The prefill worker samples the first token, the decode worker the rest: a bias and an
    allowed set hold for both, and the tokens are the offline engine's."""
    prompts = make_prompts(seed=26)[2:4]
    allowed = [40, 41, 300, 777]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={77: 100}),
        SamplingParams(
            temperature=1.3, max_tokens=6, ignore_eos=True, seed=9, allowed_token_ids=allowed
        ),
    ]
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, params)]
    cluster = cluster_factory(1, 1, "gloo")
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        cluster.prefills[0].submit(GenerateRequest(f"b{i}", prompt, p, GATEWAY), "d0")
    cluster.collector.wait_finished([("b0", 0), ("b1", 0)])
    assert not cluster.collector.failures
    outputs = [cluster.collector.output(f"b{i}") for i in range(2)]
    assert outputs == expected
    assert outputs[0] == [77] * 6 and set(outputs[1]) <= set(allowed)


@dataclass
class _Pair:
    prefill: PrefillWorker
    decode: DecodeWorker
    peer: LocalDecodePeer  # how the prefill worker reaches the decode worker
    collector: OutputCollector


@contextlib.contextmanager
def _one_pair(
    model_dir: Path,
    transfer: TransferConfig,
    make_peer: Callable[[DecodeWorker], LocalDecodePeer] = LocalDecodePeer,
    prefill_block_size: int = 8,
    decode_block_size: int = 8,
    decode_num_blocks: int = 400,
    decode_scheduler: SchedulerConfig | None = None,
    prefill_kv: dict[str, Any] | None = None,  # kv_cache_dtype, kv_cache_scales of each side
    decode_kv: dict[str, Any] | None = None,
) -> Iterator[_Pair]:
    """One prefill worker "p0" handing off to one decode worker "d0", shut down afterwards."""
    scheduler = SchedulerConfig()
    decode_cache = replace(_cache(decode_block_size, decode_num_blocks), **(decode_kv or {}))
    decode = DecodeWorker(
        "d0", _load(model_dir), decode_cache, decode_scheduler or scheduler, transfer
    )
    peer = make_peer(decode)
    prefill_cache = replace(_cache(prefill_block_size), **(prefill_kv or {}))
    prefill = PrefillWorker(
        "p0", _load(model_dir), prefill_cache, scheduler, transfer, {"d0": peer}
    )
    collector = OutputCollector([prefill.next_batch, decode.next_batch], GATEWAY)
    try:
        yield _Pair(prefill, decode, peer, collector)
    finally:
        collector.close()
        prefill.shutdown()
        decode.shutdown()
        peer.close()


def test_layout_mismatch_fails_the_request_naming_the_field(llama_dir: Path) -> None:
    transfer = TransferConfig(transport="gloo", timeout_s=5.0)
    with _one_pair(llama_dir, transfer, prefill_block_size=8, decode_block_size=16) as pair:
        prompt = make_prompts(seed=25)[4]
        request = GenerateRequest("m", prompt, SamplingParams(max_tokens=5), GATEWAY)
        pair.prefill.submit(request, "d0")
        pair.collector.wait_finished([("m", 0)], timeout_s=30)
        assert "block_size" in pair.collector.failures["m"]
        assert pair.prefill.load().kv_usage == 0.0
        # the blocks the decode worker reserved for the KV come back (they leaked)
        _eventually(lambda: pair.decode.load().kv_usage == 0.0)


def _eventually(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@pytest.mark.parametrize(
    ("decode_num_blocks", "decode_max_num_seqs", "n", "limit"),
    [(6, 256, 1, "KV cache"), (400, 1, 2, "max_num_seqs")],
    ids=["smaller-cache", "fewer-seqs"],
)
def test_a_request_the_decode_worker_cannot_hold_fails_and_frees_its_blocks(
    llama_dir: Path,
    offline: LLM,
    decode_num_blocks: int,
    decode_max_num_seqs: int,
    n: int,
    limit: str,
) -> None:
    """The decode worker is smaller than the prefill worker (its own GPU budget, or its own
    ``max_num_seqs``): a request that fits the prefill side only fails with an error naming the
    limit, and the blocks reserved for its KV come back (they leaked, even past an abort)."""
    transfer = TransferConfig(transport="gloo", timeout_s=10.0)
    decode_scheduler = SchedulerConfig(max_num_seqs=decode_max_num_seqs)
    with _one_pair(
        llama_dir,
        transfer,
        decode_num_blocks=decode_num_blocks,
        decode_scheduler=decode_scheduler,
    ) as pair:
        prompts, _ = _workload(2)
        too_big = SamplingParams(n=n, temperature=1.0, max_tokens=48, ignore_eos=True, seed=3)
        pair.prefill.submit(GenerateRequest("big", prompts[0], too_big, GATEWAY), "d0")
        pair.collector.wait_finished([("big", 0)], timeout_s=30)
        assert limit in pair.collector.failures["big"]
        assert not pair.collector.retryable["big"]  # the same on every retry
        # the failure is reported before the hand-off's lease on the prefill side ends
        _eventually(lambda: pair.decode.load().kv_usage == 0.0)
        _eventually(lambda: pair.prefill.load().kv_usage == 0.0)
        params = SamplingParams(temperature=0.0, max_tokens=8)
        pair.prefill.submit(GenerateRequest("next", prompts[1], params, GATEWAY), "d0")
        pair.collector.wait_finished([("next", 0)], timeout_s=30)
        expected = offline.generate([prompts[1]], params)[0].outputs[0].token_ids
        assert pair.collector.output("next") == expected
        assert pair.decode.load().kv_usage == 0.0


class _DeadDecodePeer(LocalDecodePeer):
    """Reserves blocks, joins the channel, then never receives: a peer that died mid-transfer."""

    def send(self, call: HandoffCall[T]) -> Future[T]:
        if isinstance(call, ReceiveKV):
            return Future()
        return super().send(call)


def test_transfer_to_a_dead_peer_times_out_and_fails_cleanly(llama_dir: Path) -> None:
    transfer = TransferConfig(transport="gloo", timeout_s=1.0)
    with _one_pair(llama_dir, transfer, _DeadDecodePeer) as pair:
        prompt = make_prompts(seed=26)[4]
        request = GenerateRequest("t", prompt, SamplingParams(max_tokens=5), GATEWAY)
        pair.prefill.submit(request, "d0")
        collector = pair.collector
        collector.wait_finished([("t", 0)], timeout_s=20)
        assert "t" in collector.failures
        assert collector.retryable["t"]  # the router may place it on another decode worker
        assert collector.output("t") == collector.output("t")[:1]  # only the first token came
        assert pair.prefill.load().kv_usage == 0.0  # the lease was released


class _CheckingDecodePeer(LocalDecodePeer):
    """Compares the received KV with the sender's, while the prefill side still holds it."""

    def __init__(self, worker: DecodeWorker, prefill_cache: list[torch.Tensor]) -> None:
        super().__init__(worker)
        self.prefill_cache = prefill_cache
        self.num_checked = 0
        self.tickets: list[TransferTicket] = []

    def send(self, call: HandoffCall[T]) -> Future[T]:
        if not isinstance(call, ReceiveKV):
            return super().send(call)
        receive = call
        self.tickets.append(receive.ticket)

        def receive_and_check() -> bool:
            ok = self.worker.receive(receive)
            result = receive.result
            assert ok, f"KV of {result.request_id} did not arrive"
            num_tokens = result.num_prompt_tokens
            sent = _prompt_slots(self.prefill_cache[0], result.block_ids, num_tokens)
            got = _prompt_slots(self.worker.engine.kv_cache, receive.block_ids, num_tokens)
            assert torch.equal(_bits(sent), _bits(got)), f"KV of {result.request_id} differs"
            self.num_checked += 1
            return ok

        checked: Future[Any] = self._executor.submit(receive_and_check)
        return checked


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def _prompt_slots(kv_cache: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    blocks = kv_cache[:, :, block_ids]  # [layers, kv_planes, n, block_size, kv_heads, head_dim]
    slots = blocks.flatten(2, 3)  # [layers, kv_planes, n * block_size, kv_heads, head_dim]
    return slots[:, :, :num_tokens]


@pytest.mark.parametrize(
    ("transport", "checksum"), [("gloo", False), ("shm", False), ("shm", True)]
)
def test_received_kv_equals_the_prefill_sides_bitwise(
    llama_dir: Path, transport: str, checksum: bool
) -> None:
    """And with ``--kv-transfer-checksum`` every ticket asks the receiver to check a CRC32."""
    transfer = TransferConfig(transport=transport, timeout_s=10.0, checksum=checksum)
    prefill_cache: list[torch.Tensor] = []
    with _one_pair(
        llama_dir, transfer, lambda decode: _CheckingDecodePeer(decode, prefill_cache)
    ) as pair:
        prefill_cache.append(pair.prefill.engine.kv_cache)
        prompts = make_prompts(seed=27)
        for i, prompt in enumerate(prompts):
            params = SamplingParams(max_tokens=3, ignore_eos=True)
            pair.prefill.submit(GenerateRequest(f"b{i}", prompt, params, GATEWAY), "d0")
        pair.collector.wait_finished([(f"b{i}", 0) for i in range(len(prompts))])
        assert not pair.collector.failures
        assert isinstance(pair.peer, _CheckingDecodePeer)
        assert pair.peer.num_checked == len(prompts)
        assert [t.checksum for t in pair.peer.tickets] == [checksum] * len(prompts)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_a_quantized_cache_hands_off_its_blocks_bitwise_and_decodes_exactly(
    llama_dir: Path, kv_cache_dtype: str
) -> None:
    """Both pools store 8-bit K/V with the same scales (given to both, as the cluster does):
    the channel moves the quantized blocks, a byte an element, bit for bit, and the split
    workers' greedy tokens equal transformers quantizing its K/V the same way."""
    scales = LLM(
        str(llama_dir), dtype="float32", device="cpu", kv_cache_dtype=kv_cache_dtype
    ).engine.kv_cache_scales
    assert scales is not None
    kv = {"kv_cache_dtype": kv_cache_dtype, "kv_cache_scales": scales}
    transfer = TransferConfig(transport="gloo", timeout_s=10.0)
    prefill_cache: list[torch.Tensor] = []
    prompts = make_prompts(seed=29)[:5]
    with _one_pair(
        llama_dir,
        transfer,
        lambda decode: _CheckingDecodePeer(decode, prefill_cache),
        prefill_kv=kv,
        decode_kv=kv,
    ) as pair:
        layout = pair.prefill.layout
        assert layout.dtype == str(pair.prefill.engine.kv_cache.dtype).removeprefix("torch.")
        assert layout.block_nbytes == layout.num_layers * 2 * 8 * layout.num_kv_heads * 16
        prefill_cache.append(pair.prefill.engine.kv_cache)
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
            pair.prefill.submit(GenerateRequest(f"q{i}", prompt, params, GATEWAY), "d0")
        pair.collector.wait_finished([(f"q{i}", 0) for i in range(len(prompts))])
        assert not pair.collector.failures
        assert isinstance(pair.peer, _CheckingDecodePeer)
        assert pair.peer.num_checked == len(prompts)
        outputs = [pair.collector.output(f"q{i}") for i in range(len(prompts))]
    assert outputs == transformers_quantized_kv_greedy(llama_dir, scales, prompts, 6)


def test_pools_with_different_kv_scales_fail_the_hand_off_naming_them(llama_dir: Path) -> None:
    scales = LLM(
        str(llama_dir), dtype="float32", device="cpu", kv_cache_dtype="int8"
    ).engine.kv_cache_scales
    assert scales is not None
    halved = KVCacheScales(
        "int8", tuple((k, tuple(v / 2 for v in vs)) for k, vs in scales.per_layer)
    )
    transfer = TransferConfig(transport="gloo", timeout_s=5.0)
    with _one_pair(
        llama_dir,
        transfer,
        prefill_kv={"kv_cache_dtype": "int8", "kv_cache_scales": scales},
        decode_kv={"kv_cache_dtype": "int8", "kv_cache_scales": halved},
    ) as pair:
        params = SamplingParams(max_tokens=5)
        pair.prefill.submit(GenerateRequest("s", make_prompts(seed=25)[4], params, GATEWAY), "d0")
        pair.collector.wait_finished([("s", 0)], timeout_s=30)
        assert "kv_scales: layer 0 V head 0" in pair.collector.failures["s"]
        assert pair.prefill.load().kv_usage == 0.0
        _eventually(lambda: pair.decode.load().kv_usage == 0.0)


def test_a_latent_cache_model_hands_off_its_latent_entries(model_dirs: dict[str, Path]) -> None:
    """DeepSeek-V3's cache is one latent plane per layer: the channel moves those entries
    (and nothing else) bitwise, and the split workers' greedy tokens equal transformers'."""
    model_dir = model_dirs["DeepseekV3ForCausalLM"]
    transfer = TransferConfig(transport="gloo", timeout_s=10.0)
    prefill_cache: list[torch.Tensor] = []
    prompts = make_prompts(seed=28)[:5]
    with _one_pair(
        model_dir, transfer, lambda decode: _CheckingDecodePeer(decode, prefill_cache)
    ) as pair:
        layout = pair.prefill.layout
        assert (layout.kv_planes, layout.num_kv_heads, layout.head_dim) == (1, 1, 40)
        assert layout.moved_block_nbytes == layout.num_layers * 8 * 40 * 4  # layers x tokens
        prefill_cache.append(pair.prefill.engine.kv_cache)
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature=0.0, max_tokens=6)
            pair.prefill.submit(GenerateRequest(f"m{i}", prompt, params, GATEWAY), "d0")
        pair.collector.wait_finished([(f"m{i}", 0) for i in range(len(prompts))])
        assert not pair.collector.failures
        assert isinstance(pair.peer, _CheckingDecodePeer)
        assert pair.peer.num_checked == len(prompts)
        outputs = [pair.collector.output(f"m{i}") for i in range(len(prompts))]
    assert outputs == [hf_greedy(model_dir, prompt, 6) for prompt in prompts]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_decode_side_failure_policy_when_kv_never_arrives(
    llama_dir: Path, offline: LLM, policy: FailurePolicy
) -> None:
    """The sender never sends: the receive times out and the request follows its policy."""
    transfer = TransferConfig(transport="gloo", timeout_s=1.0)
    decode = DecodeWorker("d0", _load(llama_dir), _cache(), SchedulerConfig(), transfer)
    prefill_engine = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8).engine
    collector = OutputCollector([decode.next_batch], GATEWAY)
    layout = decode.layout
    listener = KVChannel.listen("gloo", layout, "127.0.0.1", "silent", torch.device("cpu"))
    try:
        joining = threading.Thread(
            target=decode.connect_channel, args=(JoinChannel(listener.rendezvous, "s", "h-s"),)
        )
        joining.start()
        sender = listener.accept(5.0)
        joining.join()
        prompt = make_prompts(seed=28)[5]
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        prefill_engine.add_request("s", prompt, params, prefill_only=True)
        (result,) = prefill_engine.step().handed_off
        reservation = decode.reserve(ReserveBlocks("s", "h-s", result.num_prompt_tokens, "silent"))
        assert reservation is not None and reservation.channel_id == "silent"
        block_ids = reservation.block_ids
        ticket = TransferTicket(0, "s", len(block_ids), timeout_s=1.0)
        receive = ReceiveKV("silent", "h-s", result, ticket, block_ids, GATEWAY, policy)
        assert not decode.receive(receive)
        collector.wait_finished([("s", 0)], timeout_s=30)
        if policy == "fail":
            assert "KV transfer failed" in collector.failures["s"]
            assert not collector.retryable["s"]  # policy "fail": final, not retried elsewhere
        else:
            expected = offline.generate([prompt], params)[0].outputs[0].token_ids
            received = collector.tokens["s"][0]  # position 0 came from the prefill side
            assert [received[p] for p in sorted(received)] == expected[1:]
        assert decode.load().kv_usage == 0.0
        sender.close()
    finally:
        listener.close()
        collector.close()
        decode.shutdown()


class _AbortAfterReservePeer(LocalDecodePeer):
    """A client abort that reaches the decode worker between its reserve and the KV transfer."""

    def __init__(self, worker: DecodeWorker, doomed: set[str]) -> None:
        super().__init__(worker)
        self.doomed = doomed

    def send(self, call: HandoffCall[T]) -> Future[T]:
        answer = super().send(call)
        if isinstance(call, ReserveBlocks) and call.request_id in self.doomed:
            answer.result()
            self.worker.abort(call.request_id)
        return answer


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_abort_between_reserve_and_transfer_keeps_the_channel_usable(
    llama_dir: Path, offline: LLM, transport: str
) -> None:
    transfer = TransferConfig(transport=transport, timeout_s=10.0)
    doomed = {"doomed"}
    with _one_pair(
        llama_dir, transfer, lambda decode: _AbortAfterReservePeer(decode, doomed)
    ) as pair:
        prompts, _ = _workload(2)
        params = SamplingParams(temperature=0.0, max_tokens=8)
        pair.prefill.submit(GenerateRequest("doomed", prompts[0], params, GATEWAY), "d0")
        began = time.monotonic()
        pair.prefill.submit(GenerateRequest("next", prompts[1], params, GATEWAY), "d0")
        pair.collector.wait_finished([("next", 0)], timeout_s=30)
        elapsed = time.monotonic() - began
        assert elapsed < transfer.timeout_s / 2, elapsed  # no transfer waited out its deadline
        assert not pair.collector.failures
        expected = offline.generate([prompts[1]], params)[0].outputs[0].token_ids
        assert pair.collector.output("next") == expected
        reserved = pair.decode.loop.call(lambda engine: engine.reserved_blocks("doomed"))
        assert reserved is None


class _AbortBeforeReservePeer(LocalDecodePeer):
    """A client abort that reaches the decode worker before the prefill worker's hand-off does.

    The gateway sends its abort to both workers as soon as the client leaves; after the first
    token that is often while the hand-off is on its way. With ``full``, the decode worker has
    no blocks to spare, so the prompt comes without its KV.
    """

    def __init__(self, worker: DecodeWorker, doomed: set[str], full: bool) -> None:
        super().__init__(worker)
        self.doomed = doomed
        self.full = full

    def send(self, call: HandoffCall[T]) -> Future[T]:
        if isinstance(call, ReserveBlocks) and call.request_id in self.doomed:
            self.worker.abort(call.request_id)
            if self.full:
                no_room: Future[Any] = answered(None)
                return no_room
        return super().send(call)


@pytest.mark.parametrize("full", [False, True], ids=["with-kv", "without-kv"])
def test_abort_that_overtakes_the_hand_off_drops_the_request(
    llama_dir: Path, offline: LLM, full: bool
) -> None:
    transfer = TransferConfig(transport="shm", timeout_s=10.0, reserve_timeout_s=0.0)
    doomed = {"doomed"}
    with _one_pair(
        llama_dir, transfer, lambda decode: _AbortBeforeReservePeer(decode, doomed, full)
    ) as pair:
        prompts, _ = _workload(2)
        params = SamplingParams(temperature=0.0, max_tokens=8)
        pair.prefill.submit(GenerateRequest("doomed", prompts[0], params, GATEWAY), "d0")
        pair.prefill.submit(GenerateRequest("next", prompts[1], params, GATEWAY), "d0")
        pair.collector.wait_finished([("next", 0)], timeout_s=30)
        expected = offline.generate([prompts[1]], params)[0].outputs[0].token_ids
        assert pair.collector.output("next") == expected  # the channel stayed in step
        decode = pair.decode
        assert not decode.loop.call(lambda engine: engine.has_unfinished_requests())
        assert decode.loop.call(lambda engine: engine.reserved_blocks("doomed")) is None
        assert pair.collector.output("doomed") == pair.collector.output("doomed")[:1]
        assert decode.load().kv_usage == 0.0


def test_a_failed_transfer_leaves_the_hand_offs_queued_behind_it_a_working_channel(
    cluster_factory,  # type: ignore[no-untyped-def]
    offline: LLM,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The decode worker receives "slow" past the deadline: that transfer fails and breaks the
    channel. The hand-off queued behind it to the same decode worker gets a new channel (it held
    the broken one, and with policy "fail" it failed too)."""
    transfer = TransferConfig(transport="gloo", timeout_s=1.0, failure_policy="fail")
    cluster = cluster_factory(1, 1, transfer=transfer, max_num_batched_tokens=64)
    (prefill,), (decode,) = cluster.prefills, cluster.decodes
    receive = decode._recv

    def late_for_slow(channel_id, channel, block_ids, ticket):  # type: ignore[no-untyped-def]
        if ticket.request_id == "slow":
            time.sleep(1.5)  # the sender has given up
        return receive(channel_id, channel, block_ids, ticket)

    monkeypatch.setattr(decode, "_recv", late_for_slow)
    prompts, _ = _workload(2)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    prefill.submit(GenerateRequest("slow", prompts[0], params, GATEWAY), "d0")
    prefill.submit(GenerateRequest("next", prompts[1], params, GATEWAY), "d0")
    cluster.collector.wait_finished([("slow", 0), ("next", 0)], timeout_s=30)
    assert "KV transfer" in cluster.collector.failures["slow"]
    assert "next" not in cluster.collector.failures
    expected = offline.generate([prompts[1]], params)[0].outputs[0].token_ids
    assert cluster.collector.output("next") == expected


class _StuckDecodePeer(LocalDecodePeer):
    """A decode worker that never answers a reserve ("hung") or never has room ("full")."""

    def __init__(self, worker: DecodeWorker, how: str) -> None:
        super().__init__(worker)
        self.how = how

    def send(self, call: HandoffCall[T]) -> Future[T]:
        if not isinstance(call, ReserveBlocks):
            return super().send(call)
        answer: Future[Any] = answered(None) if self.how == "full" else Future()
        return answer


@contextlib.contextmanager
def _stuck_d0_and_healthy_d1(
    model_dir: Path, how: str
) -> Iterator[tuple[PrefillWorker, OutputCollector]]:
    """Prefill worker "p0" with one hand-off thread per decode worker, d0 stuck (``how``:
    "hung" or "full", see ``_StuckDecodePeer``) and d1 healthy; deadlines of 4 s."""
    transfer = TransferConfig(
        transport="gloo", timeout_s=4.0, reserve_timeout_s=4.0, max_concurrent_handoffs=1
    )
    scheduler = SchedulerConfig()
    decodes = [
        DecodeWorker(f"d{i}", _load(model_dir), _cache(), scheduler, transfer) for i in range(2)
    ]
    peers = {"d0": _StuckDecodePeer(decodes[0], how), "d1": LocalDecodePeer(decodes[1])}
    prefill = PrefillWorker("p0", _load(model_dir), _cache(), scheduler, transfer, peers)
    collector = OutputCollector([prefill.next_batch, *(d.next_batch for d in decodes)], GATEWAY)
    try:
        yield prefill, collector
    finally:
        collector.close()
        prefill.shutdown()
        for peer in peers.values():
            peer.close()
        for decode in decodes:
            decode.shutdown()


@pytest.mark.parametrize("how", ["hung", "full"])
def test_a_stuck_decode_worker_does_not_hold_up_hand_offs_to_the_others(
    llama_dir: Path, offline: LLM, how: str
) -> None:
    """One hand-off thread per decode worker: while d0 hangs on (or keeps refusing) a reserve,
    a hand-off to d1 goes through at once (it waited behind d0's until that one gave up, for
    ever for a hung d0). The stuck one ends after its deadline: failed for another worker to
    retry, or prefilled again on d0 once that has room."""
    with _stuck_d0_and_healthy_d1(llama_dir, how) as (prefill, collector):
        prompts, _ = _workload(2)
        params = SamplingParams(temperature=0.0, max_tokens=8)
        prefill.submit(GenerateRequest("stuck", prompts[0], params, GATEWAY), "d0")
        time.sleep(0.2)  # its hand-off is under way
        began = time.monotonic()
        prefill.submit(GenerateRequest("other", prompts[1], params, GATEWAY), "d1")
        collector.wait_finished([("other", 0)], timeout_s=30)
        assert time.monotonic() - began < 2.0  # well before d0's deadlines
        expected = offline.generate(prompts, params)
        assert collector.output("other") == expected[1].outputs[0].token_ids
        collector.wait_finished([("stuck", 0)], timeout_s=30)
        if how == "hung":
            assert collector.retryable["stuck"]
        else:
            assert collector.output("stuck") == expected[0].outputs[0].token_ids
        assert prefill.load().kv_usage == 0.0  # no lease is held for a stuck peer


def test_channels_the_decode_side_closes_over_its_cap_are_never_sent_on(
    cluster_factory,  # type: ignore[no-untyped-def]
    offline: LLM,
) -> None:
    """Two prefill workers take turns handing off to one decode worker that keeps one channel
    open: each new channel closes the other's on the decode side. The reserve tells the prefill
    worker its channel is gone, and a channel stays open from the reserve to the receive, so no
    transfer goes to a closed end (two in eight failed, "no open KV channel")."""
    transfer = TransferConfig(
        transport="gloo", timeout_s=5.0, max_channels=1, failure_policy="fail"
    )
    cluster = cluster_factory(2, 1, transfer=transfer, max_num_batched_tokens=64)
    (decode,) = cluster.decodes
    prompts, _ = _workload(8)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    expected = offline.generate(prompts, params)
    for i, prompt in enumerate(prompts):
        request = GenerateRequest(f"t{i}", prompt, params, GATEWAY)
        cluster.prefills[i % 2].submit(request, "d0")
        cluster.collector.wait_finished([(f"t{i}", 0)], timeout_s=30)
    assert not cluster.collector.failures
    for i in range(len(prompts)):
        assert cluster.collector.output(f"t{i}") == expected[i].outputs[0].token_ids
    load = decode.load()
    assert load.counters.num_kv_transfers == len(prompts)  # every prompt's KV arrived
    assert load.kv_usage == 0.0
    assert decode.channels.num_pins == 0  # every pin ended with its receive


def test_a_reservation_keeps_its_channel_open_past_the_cap_until_it_ends(llama_dir: Path) -> None:
    """Cap 1 on the decode side: a channel named by a reservation is not closed when another
    one opens (its KV is about to be sent on it); once the reservation ends, it is."""
    transfer = TransferConfig(transport="fake", timeout_s=5.0, max_channels=1)
    decode = DecodeWorker("d0", _load(llama_dir), _cache(), SchedulerConfig(), transfer)
    listeners = []

    def open_channel(channel_id: str) -> KVChannel:
        listener = KVChannel.listen("fake", decode.layout, "127.0.0.1", channel_id, "cpu")
        listeners.append(listener)
        decode.connect_channel(JoinChannel(listener.rendezvous, "", ""))  # for no hand-off
        return listener.accept(5.0)

    try:
        senders = [open_channel("a")]
        reservation = decode.reserve(ReserveBlocks("r", "h-r", 20, "a"))
        assert reservation is not None and reservation.channel_id == "a"
        senders.append(open_channel("b"))
        assert "a" in decode.channels and "b" in decode.channels  # "a" is pinned for "r"
        unknown = decode.reserve(ReserveBlocks("s", "h-s", 20, "gone"))
        assert unknown is not None and unknown.channel_id is None  # not open here: no pin
        decode.cancel_reservation(CancelReservation("r", "h-r"))
        senders.append(open_channel("c"))
        assert "c" in decode.channels  # unpinned "a" and idle "b" closed
        assert "a" not in decode.channels and "b" not in decode.channels
    finally:
        for listener in listeners:
            listener.close()
        decode.shutdown()


def test_a_reserve_answered_after_the_deadline_is_refused_by_its_cancel(
    llama_dir: Path, offline: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode worker answers a reserve after the prefill worker's deadline: the hand-off
    has failed and its cancel came first. The late reserve must not take blocks and a pin for
    ever (they leaked, and the request's retry on that worker failed "already in use")."""
    transfer = TransferConfig(transport="gloo", timeout_s=1.0, reserve_timeout_s=1.0)
    with _one_pair(llama_dir, transfer) as pair:
        prompts, _ = _workload(2)
        params = SamplingParams(temperature=0.0, max_tokens=4)
        pair.prefill.submit(GenerateRequest("warm", prompts[0], params, GATEWAY), "d0")
        pair.collector.wait_finished([("warm", 0)], timeout_s=30)
        reserve = pair.decode.reserve

        def late_reserve(*args):  # type: ignore[no-untyped-def]
            time.sleep(1.3)
            return reserve(*args)

        monkeypatch.setattr(pair.decode, "reserve", late_reserve)
        pair.prefill.submit(GenerateRequest("late", prompts[1], params, GATEWAY), "d0")
        pair.collector.wait_finished([("late", 0)], timeout_s=30)
        assert "TimeoutError" in pair.collector.failures.pop("late")  # a reason, not ""
        time.sleep(1.0)  # the late reserve has run
        assert pair.decode.load().kv_usage == 0.0
        assert pair.decode.channels.num_pins == 0
        monkeypatch.setattr(pair.decode, "reserve", reserve)
        pair.prefill.submit(GenerateRequest("late", prompts[1], params, GATEWAY), "d0")
        pair.collector.wait_finished([("late", 0)], timeout_s=30)
        assert "late" not in pair.collector.failures
        expected = offline.generate([prompts[1]], params)[0].outputs[0].token_ids
        assert pair.collector.output("late") == expected


def test_many_prefill_workers_share_a_decode_worker_over_its_channel_cap(
    cluster_factory,  # type: ignore[no-untyped-def]
    offline: LLM,
) -> None:
    """Three prefill workers hand off at once to a decode worker that keeps one channel. A
    channel is pinned as the decode worker joins it, so another's joining cannot close it
    before its transfer (2-5 of 18 hand-offs failed "decode worker closed channel"); and once
    the transfers are over, both sides are back within their cap (channels skipped while busy
    stayed open)."""
    transfer = TransferConfig(
        transport="gloo", timeout_s=10.0, max_channels=1, failure_policy="fail"
    )
    cluster = cluster_factory(3, 1, transfer=transfer, max_num_batched_tokens=64)
    prompts, _ = _workload(18)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    expected = offline.generate(prompts, params)
    for i, prompt in enumerate(prompts):
        cluster.prefills[i % 3].submit(GenerateRequest(f"s{i}", prompt, params, GATEWAY), "d0")
    cluster.collector.wait_finished([(f"s{i}", 0) for i in range(len(prompts))], timeout_s=60)
    assert not cluster.collector.failures
    for i in range(len(prompts)):
        assert cluster.collector.output(f"s{i}") == expected[i].outputs[0].token_ids
    (decode,) = cluster.decodes
    _eventually(lambda: decode.channels.num_pins == 0)
    assert len(decode.channels.remove_all()) <= 1
    for prefill in cluster.prefills:
        assert len(prefill.channels) <= 1


def test_a_retargeted_hand_off_leaves_the_hung_decode_workers_queue(llama_dir: Path) -> None:
    """d0 hangs; "moved" waits for a hand-off thread of d0's behind "stuck". The router points
    it at d1: it goes there at once (it waited out d0's deadline first)."""
    with _stuck_d0_and_healthy_d1(llama_dir, "hung") as (prefill, collector):
        prompts, _ = _workload(2)
        params = SamplingParams(temperature=0.0, max_tokens=8)
        prefill.submit(GenerateRequest("stuck", prompts[0], params, GATEWAY), "d0")
        prefill.submit(GenerateRequest("moved", prompts[1], params, GATEWAY), "d0")
        _eventually(lambda: 0 in collector.tokens["moved"][0])  # prefilled: hand-off queued
        began = time.monotonic()
        assert prefill.retarget("moved", "d1")
        collector.wait_finished([("moved", 0)], timeout_s=30)
        assert time.monotonic() - began < 2.0  # well before d0's deadline
        assert "moved" not in collector.failures
        collector.wait_finished([("stuck", 0)], timeout_s=30)


def test_a_reservation_whose_transfer_never_comes_expires(llama_dir: Path) -> None:
    """Its prefill worker died after reserving: the decode worker gives the blocks back once
    the reservation outlives every deadline of a live prefill worker (they leaked for good).
    A transfer that still comes after that fails its request for the router to place again."""
    transfer = TransferConfig(transport="gloo", timeout_s=0.25, max_concurrent_handoffs=1)
    assert transfer.reservation_ttl_s == 1.0
    decode = DecodeWorker("d0", _load(llama_dir), _cache(), SchedulerConfig(), transfer)
    prefill_engine = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8).engine
    collector = OutputCollector([decode.next_batch], GATEWAY)
    try:
        prompt = make_prompts(seed=28)[5]
        params = SamplingParams(temperature=0.0, max_tokens=6)
        prefill_engine.add_request("x", prompt, params, prefill_only=True)
        (result,) = prefill_engine.step().handed_off
        expires_at = time.monotonic() + transfer.reservation_ttl_s  # at the soonest
        reservation = decode.reserve(ReserveBlocks("x", "h-x", result.num_prompt_tokens, None))
        assert reservation is not None and decode.load().kv_usage > 0
        _eventually(lambda: decode.load().kv_usage == 0.0)  # the worker's sweep gave it back
        assert time.monotonic() >= expires_at
        ticket = TransferTicket(0, "x", len(reservation.block_ids), timeout_s=0.25)
        block_ids = reservation.block_ids
        late = ReceiveKV("p0->d0/0", "h-x", result, ticket, block_ids, GATEWAY, "fail")
        assert not decode.receive(late)
        collector.wait_finished([("x", 0)], timeout_s=10)
        assert "expired" in collector.failures["x"] and collector.retryable["x"]
    finally:
        collector.close()
        decode.shutdown()


def test_a_request_whose_kv_is_arriving_is_refused_a_second_submission(
    cluster_factory,  # type: ignore[no-untyped-def]
    offline: LLM,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each placement has its own id, so the same id submitted while its KV arrives is the
    caller's error: refused, naming the field, and the hand-off lands as if it had not come."""
    prompts, params = _workload(1)
    expected = offline.generate(prompts, params)[0].outputs[0].token_ids
    cluster = cluster_factory(1, 1, "gloo")
    (prefill,), (decode,) = cluster.prefills, cluster.decodes
    receive, receiving, release = decode._recv, threading.Event(), threading.Event()

    def held_receive(*args, **kwargs):  # type: ignore[no-untyped-def]
        receiving.set()
        release.wait(10)
        return receive(*args, **kwargs)

    monkeypatch.setattr(decode, "_recv", held_receive)
    request = GenerateRequest("r", prompts[0], params[0], GATEWAY)
    prefill.submit(request, "d0")
    assert receiving.wait(30)
    with pytest.raises(ValueError, match="request_id 'r' is already receiving its KV here"):
        decode.submit(request)
    release.set()
    cluster.collector.wait_finished([("r", 0)])
    assert not cluster.collector.failures
    assert cluster.collector.output("r") == expected


class _FullForAWhilePeer(LocalDecodePeer):
    """A decode worker whose cache is full (reserves refused) for ``full_for_s`` from the
    first ask."""

    def __init__(self, worker: DecodeWorker, full_for_s: float) -> None:
        super().__init__(worker)
        self.full_for_s = full_for_s
        self.room_at: float | None = None

    def send(self, call: HandoffCall[T]) -> Future[T]:
        if isinstance(call, ReserveBlocks):
            if self.room_at is None:
                self.room_at = time.monotonic() + self.full_for_s
            if time.monotonic() < self.room_at:
                return answered(None)  # type: ignore[arg-type]
        return super().send(call)


@pytest.mark.parametrize("room_comes", [True, False], ids=["room-comes", "stays-full"])
def test_a_hand_off_reports_how_long_it_waited_for_the_decode_workers_blocks(
    llama_dir: Path, offline: LLM, room_comes: bool
) -> None:
    """The latency model's hand-off wait (router/latency_model.py) comes from these reports:
    the wait, the decode worker it was for; a hand-off that gave up (the decode worker then
    computes the prompt) reports its wait with no blocks moved; and while it waits, the
    prefill worker's load reports carry its wait so far."""
    transfer = TransferConfig(transport="gloo", timeout_s=10.0, reserve_timeout_s=1.0)
    full_for_s = 0.4 if room_comes else 60.0
    with _one_pair(llama_dir, transfer, lambda d: _FullForAWhilePeer(d, full_for_s)) as pair:
        prompt = make_prompts(seed=31)[2]
        params = SamplingParams(temperature=0.0, max_tokens=6)
        pair.prefill.submit(GenerateRequest("w", prompt, params, GATEWAY), "d0")
        # while it waits, its load reports say so (the wait so far, the decode worker)
        reports = [pair.prefill.load()]
        deadline = time.monotonic() + 30
        while not reports[-1].block_waits and time.monotonic() < deadline:
            time.sleep(0.01)
            reports.append(pair.prefill.load())
        waits = reports[-1].block_waits
        assert [w.decode_worker_id for w in waits] == ["d0"] and waits[0].waited_s >= 0
        pair.collector.wait_finished([("w", 0)], timeout_s=60)
        reports.append(pair.prefill.load())
        assert reports[-1].block_waits == ()  # ended
        expected = offline.generate([prompt], params)[0].outputs[0].token_ids
        assert pair.collector.output("w") == expected
        (timing,) = [t for report in reports for t in report.transfer_timings]
        assert timing.decode_worker_id == "d0"
        if room_comes:
            assert 0.35 <= timing.reserve_wait_s < 10.0
            assert timing.num_blocks == -(-len(prompt) // 8) and timing.transport == "gloo"
        else:  # the reserve timeout, then given up
            assert 1.0 <= timing.reserve_wait_s < 10.0
            assert (timing.num_blocks, timing.num_bytes, timing.transport) == (0, 0, "")
