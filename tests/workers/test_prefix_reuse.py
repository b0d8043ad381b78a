"""A conversation's KV reused between a prefill and a decode worker, both ways, over real
channels: a hand-off leaves out the prompt's blocks the decode worker caches already, and a
prefill worker copies the prefix a decode worker caches before it computes the rest. Outputs
stay token for token the offline engine's."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from decode_worker.prefix_lender import PrefixLender
from decode_worker.worker import DecodeWorker
from engine import LLM, GenerateRequest, SamplingParams
from engine.engine_config import CacheConfig, LoadConfig
from engine.kv_cache.budget import KVBudget
from engine.messages import LendPrefix, ReturnLent, SendLentBlocks
from engine.scheduler import SchedulerConfig
from kv_transfer import TransferStats, TransferTicket
from kv_transfer.messages import ChannelRendezvous
from kv_transfer.policy import TransferConfig
from prefill_worker.worker import PrefillWorker
from tests.workers.local_peer import LocalDecodePeer
from tests.workers.output_collector import OutputCollector

GATEWAY = "test-gateway"
BLOCK = 8
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4  # the tiny Llama's: layers, k/v, kv heads, dim, fp32


class Pair:
    """One prefill and one decode worker in this process, and their outputs."""

    def __init__(self, model_dir: Path, transport: str, ttl_s: float = 30.0) -> None:
        load = LoadConfig(str(model_dir), dtype="float32", device="cpu")
        cache = CacheConfig(block_size=BLOCK, budget=KVBudget(num_blocks=200))
        scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
        transfer = TransferConfig(transport=transport, timeout_s=10.0, reserve_timeout_s=ttl_s)
        self.decode = DecodeWorker("d0", load, cache, scheduler, transfer)
        self.peer = LocalDecodePeer(self.decode)
        self.prefill = PrefillWorker("p0", load, cache, scheduler, transfer, {"d0": self.peer})
        sources = [self.prefill.next_batch, self.decode.next_batch]
        self.collector = OutputCollector(sources, GATEWAY)
        self._ids = iter(range(1_000_000))

    def generate(
        self, prompt: list[int], max_tokens: int, fetch_blocks: int = 0, salt: str | None = None
    ) -> list[int]:
        request_id = f"r{next(self._ids)}"
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        request = GenerateRequest(request_id, prompt, params, GATEWAY, cache_salt=salt)
        self.prefill.submit(request, "d0", fetch_blocks)
        self.collector.wait_finished([(request_id, 0)])
        assert not self.collector.failures
        return self.collector.output(request_id)

    def prefill_tokens(self) -> int:
        return self.prefill.engine.stats.num_prefill_tokens

    def received_bytes(self) -> int:
        return self.decode.load().counters.num_kv_transfer_bytes

    def wait_all_blocks_free(self, timeout_s: float = 30.0) -> None:
        """Until no block of either cache is held and no fetch is under way (a finished
        request's blocks are given back by the step after its last token, the prefill worker's
        once the hand-off ends)."""
        deadline = time.monotonic() + timeout_s
        while True:
            used = {
                w.worker_id: w.loop.call(lambda e: e.block_manager.pool.num_used_blocks)
                for w in (self.prefill, self.decode)
            }
            if not any(used.values()) and not self.prefill.num_fetching:
                return
            assert time.monotonic() < deadline, f"blocks still held: {used}"
            time.sleep(0.01)

    def close(self) -> None:
        self.collector.close()
        self.prefill.shutdown()
        self.peer.close()
        self.decode.shutdown()


@pytest.fixture
def offline(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), dtype="float32", device="cpu", block_size=BLOCK)


@pytest.fixture
def pairs(llama_dir: Path) -> Iterator:  # type: ignore[type-arg]
    made: list[Pair] = []

    def make(transport: str = "gloo") -> Pair:
        made.append(Pair(llama_dir, transport))
        return made[-1]

    yield make
    for pair in made:
        pair.close()


def _greedy(offline: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return offline.generate([prompt], params)[0].outputs[0].token_ids


def _turns(seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(45)], [rng.randrange(3, 250) for _ in range(11)]


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_a_handoff_leaves_out_the_blocks_the_decode_worker_caches(
    pairs,  # type: ignore[no-untyped-def]
    offline: LLM,
    transport: str,
) -> None:
    """Turn 2 repeats turn 1 and its reply: the decode worker caches turn 1's prompt and the
    reply's full blocks, so turn 2's hand-off moves only the blocks after them."""
    pair = pairs(transport)
    turn_1, user_2 = _turns(1)
    reply_1 = pair.generate(turn_1, max_tokens=20)
    assert reply_1 == _greedy(offline, turn_1, 20)
    assert pair.received_bytes() == 6 * BLOCK_BYTES  # 45 tokens: 6 blocks
    turn_2 = turn_1 + reply_1 + user_2  # 76 tokens: 10 blocks
    reply_2 = pair.generate(turn_2, max_tokens=9)
    assert reply_2 == _greedy(offline, turn_2, 9)
    # the decode worker caches the first 64 tokens (turn 1 and 19 of the reply's 20: its last
    # token's KV is never computed): blocks 8 and 9 move
    cached = (len(turn_1) + len(reply_1) - 1) // BLOCK
    assert cached == 8
    assert pair.received_bytes() == (6 + 10 - cached) * BLOCK_BYTES
    pair.wait_all_blocks_free()  # (the shared blocks were given back with the request)


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_a_prefill_worker_copies_the_prefix_the_decode_worker_caches(
    pairs,  # type: ignore[no-untyped-def]
    offline: LLM,
    transport: str,
) -> None:
    """Turn 2 goes to the prefill worker with the fetch: it copies the blocks of turn 1's reply
    it lacks from the decode worker, computes only the tokens after them, and hands back only
    the blocks the decode worker does not cache. Again, and another tenant's same turn copies
    nothing (its hashes differ): each reply is the offline engine's."""
    pair = pairs(transport)
    turn_1, user_2 = _turns(2)
    reply_1 = pair.generate(turn_1, max_tokens=20)
    turn_2 = turn_1 + reply_1 + user_2
    cached = (len(turn_1) + len(reply_1) - 1) // BLOCK  # 8 blocks on the decode worker
    computed_before = pair.prefill_tokens()
    reply_2 = pair.generate(turn_2, max_tokens=9, fetch_blocks=cached)
    assert reply_2 == _greedy(offline, turn_2, 9)
    # the prefill worker held turn 1's 5 full blocks; it copied blocks 5, 6 and 7
    assert pair.prefill.fetcher.num_fetched_blocks == cached - len(turn_1) // BLOCK == 3
    assert pair.prefill.fetcher.totals.snapshot()[1] == 3 * BLOCK_BYTES
    assert pair.decode.lender.totals.snapshot()[1] == 3 * BLOCK_BYTES
    assert pair.prefill_tokens() - computed_before == len(turn_2) - cached * BLOCK
    assert pair.received_bytes() == (6 + 10 - cached) * BLOCK_BYTES
    # the fetched blocks stay in the prefill worker's cache, held no longer; the lent ones too
    pair.wait_all_blocks_free()
    # the other tenant: no block of the conversation is its own, nothing is copied
    assert pair.generate(turn_2, max_tokens=9, fetch_blocks=cached, salt="other") == reply_2
    assert pair.prefill.fetcher.num_fetched_blocks == 3


def test_a_fetch_of_what_the_decode_worker_no_longer_holds_computes_the_prompt(
    pairs,  # type: ignore[no-untyped-def]
    offline: LLM,
) -> None:
    """The router's index was behind: the decode worker holds nothing of the prompt. The fetch
    copies nothing, gives its blocks back, and the prompt is computed in full."""
    pair = pairs()
    prompt, _ = _turns(3)
    assert pair.generate(prompt, max_tokens=5, fetch_blocks=4) == _greedy(offline, prompt, 5)
    assert pair.prefill.fetcher.num_fetched_blocks == 0
    assert pair.prefill_tokens() == len(prompt)
    pair.wait_all_blocks_free()


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _decode_with_lender(
    pair: Pair, seed: int
) -> tuple[DecodeWorker, list[int], PrefixLender, _Clock]:
    """The pair's decode worker once it has decoded a prompt (so it caches the prompt's 5
    blocks), the prompt, and a lender over it on a clock of the test's (TTL 2 s)."""
    prompt, _ = _turns(seed)
    pair.generate(prompt, max_tokens=12)
    decode, clock = pair.decode, _Clock()
    lender = PrefixLender(
        "d0", decode.loop, decode.engine.kv_cache, decode.layout, "127.0.0.1", 5.0, 2.0, clock=clock
    )
    return decode, prompt, lender, clock


def test_a_lend_never_sent_is_given_back_when_it_expires(
    pairs,  # type: ignore[no-untyped-def]
) -> None:
    """A prefill worker that dies between the lend and the send holds the decode worker's
    blocks until the lend's deadline, then no more; a send that comes later sends nothing."""
    pair = pairs()
    decode, prompt, lender, clock = _decode_with_lender(pair, seed=4)
    hashes = decode.engine.servable_prompt_hashes(prompt, None)
    assert lender.lend(LendPrefix("lend-1", tuple(hashes))) == len(hashes) == 5
    assert lender.lend(LendPrefix("lend-2", tuple(hashes[2:]))) == 3
    pool = decode.engine.block_manager.pool
    assert decode.loop.call(lambda e: pool.num_used_blocks) == 5  # shared by the two lends
    clock.now = 1.5
    assert lender.expire() == []
    lender.give_back(ReturnLent("lend-2"))
    clock.now = 2.5
    assert lender.expire() == ["lend-1"]
    assert decode.loop.call(lambda e: pool.num_used_blocks) == 0
    ticket = TransferTicket(0, "late", 5, 5.0)
    assert not lender.send(SendLentBlocks("lend-1", "no-such-channel", ticket))
    # the tenant's salt names other blocks: none of them is lent
    salted = decode.engine.servable_prompt_hashes(prompt, "other")
    assert lender.lend(LendPrefix("lend-3", tuple(salted))) == 0


def test_a_request_aborted_while_its_prefix_is_fetched_holds_nothing(
    pairs,  # type: ignore[no-untyped-def]
    offline: LLM,
) -> None:
    """An abort that comes while the prefix is copied (or right after): the request never runs
    or is dropped, every block held for it goes back on both sides, and the next turn is
    served as ever."""
    pair = pairs()
    turn_1, user_2 = _turns(5)
    reply_1 = pair.generate(turn_1, max_tokens=20)
    turn_2 = turn_1 + reply_1 + user_2
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    for attempt in range(3):
        request_id = f"aborted-{attempt}"
        pair.prefill.submit(GenerateRequest(request_id, turn_2, params, GATEWAY), "d0", 8)
        time.sleep(0.005 * attempt)
        pair.prefill.abort(request_id)
        pair.decode.abort(request_id)
    pair.wait_all_blocks_free()
    assert not pair.prefill.loop.call(lambda e: e.has_unfinished_requests())
    assert pair.generate(turn_2, max_tokens=9, fetch_blocks=8) == _greedy(offline, turn_2, 9)


class _HeldSend:
    """A lend channel whose send waits until the test lets it go (a slow transfer)."""

    broken = False
    rendezvous = ChannelRendezvous("fake", "lend-channel", "127.0.0.1", 0)

    def __init__(self) -> None:
        self.started, self.go = threading.Event(), threading.Event()

    def send_blocks(self, kv_cache: object, block_ids: list[int], ticket: object) -> TransferStats:
        self.started.set()
        assert self.go.wait(30)
        return TransferStats(0, len(block_ids) * BLOCK_BYTES, 1, 0.0, 0.0, 0.0, 0.0, 0.0)

    def close(self) -> None:
        self.broken = True


def test_a_lend_being_sent_does_not_expire_under_the_send(
    pairs,  # type: ignore[no-untyped-def]
) -> None:
    """The sweeper passes while a lend's blocks are on the wire: they stay held (no eviction
    may reuse them mid-send) and go back when the send ends."""
    pair = pairs()
    decode, prompt, lender, clock = _decode_with_lender(pair, seed=6)
    hashes = decode.engine.servable_prompt_hashes(prompt, None)
    assert lender.lend(LendPrefix("lend-1", tuple(hashes))) == 5
    channel = _HeldSend()
    accepted: Future[object] = Future()
    accepted.set_result(channel)
    lender._channels["p0"] = ("lend-channel", accepted)  # type: ignore[assignment]
    ticket = TransferTicket(0, "r", 5, 5.0)
    answers: list[bool] = []
    sending = threading.Thread(
        target=lambda: answers.append(lender.send(SendLentBlocks("lend-1", "lend-channel", ticket)))
    )
    sending.start()
    assert channel.started.wait(30)
    clock.now = 10.0
    assert lender.expire() == []
    pool = decode.engine.block_manager.pool
    assert decode.loop.call(lambda e: pool.num_used_blocks) == 5
    channel.go.set()
    sending.join(30)
    assert answers == [True]
    assert decode.loop.call(lambda e: pool.num_used_blocks) == 0
