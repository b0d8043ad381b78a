"""The gateway's text pipeline on scripted token streams: text deltas per sample from a
byte-level BPE (emoji, CJK), stop strings across samples, usage, and abort on early end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from engine.messages import TokenEvent
from engine.sampling.params import SamplingParams
from router.gateway.spec import GenerationSpec
from router.gateway.text_stream import SampleDelta, TextGeneration, merged_deltas
from router.latency_forecast import AllowedWorkers

TEXT = "Hello 😀🚀 world 世界 naïve café 👩‍👩‍👧 end"


class ScriptedTokens:
    """Plays fixed token ids as a cluster's event stream, sample by sample interleaved."""

    def __init__(self, samples: list[list[int]], num_cached: int = 0, pace_s: float = 0) -> None:
        self.samples = samples
        self.num_cached = num_cached
        self.pace_s = pace_s  # pause between tokens, like a model's step time
        self.closed_early = False

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        allowed: AllowedWorkers | None = None,
    ) -> AsyncGenerator[TokenEvent, None]:
        num_sent = 0
        total = sum(len(s) for s in self.samples)
        try:
            for position in range(max(len(s) for s in self.samples)):
                for index, tokens in enumerate(self.samples):
                    if position < len(tokens):
                        finish = "length" if position == len(tokens) - 1 else None
                        cached = self.num_cached if position == 0 else 0
                        num_sent += 1
                        yield TokenEvent(
                            "r", index, position, tokens[position], None, finish, cached
                        )
                        await asyncio.sleep(self.pace_s)
        finally:
            self.closed_early = num_sent < total


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)


def _run(generation: TextGeneration) -> list[SampleDelta]:
    async def collect() -> list[SampleDelta]:
        return [delta async for delta in generation.deltas()]

    return asyncio.run(collect())


def _spec(n: int, stop: Sequence[str] = ()) -> GenerationSpec:
    return GenerationSpec([5, 6, 7], SamplingParams(n=n, max_tokens=100), tuple(stop), None)


def test_deltas_rebuild_each_sample_without_broken_characters(tokenizer: Any) -> None:
    tokens = tokenizer.encode(TEXT)
    backend = ScriptedTokens([tokens, tokens[:9]], num_cached=16)
    generation = TextGeneration(backend, tokenizer, _spec(2), "r")
    deltas = _run(generation)
    for index, expected in ((0, TEXT), (1, tokenizer.decode(tokens[:9]))):
        mine = [d for d in deltas if d.index == index]
        assert "".join(d.text for d in mine) == expected
        assert all("\ufffd" not in d.text for d in mine[:-1])
        assert [t for d in mine for t in d.token_ids] == (tokens if index == 0 else tokens[:9])
        assert [d.finish_reason for d in mine][-1] == "length"
    assert generation.num_completion_tokens == len(tokens) + 9
    assert generation.num_cached_tokens == 16
    assert not backend.closed_early


def test_stop_string_ends_one_sample_and_the_stream_ends_when_all_have(tokenizer: Any) -> None:
    tokens = tokenizer.encode(TEXT)
    backend = ScriptedTokens([tokens, tokens])
    generation = TextGeneration(backend, tokenizer, _spec(2, stop=["世界"]), "r")
    deltas = _run(generation)
    for index in (0, 1):
        mine = [d for d in deltas if d.index == index]
        assert "".join(d.text for d in mine) == TEXT[: TEXT.index("世界")]
        assert mine[-1].finish_reason == "stop"
    assert backend.closed_early  # leaving the stream aborts what still runs
    # usage counts the tokens up to the one that completed the stop string
    assert generation.num_completion_tokens < 2 * len(tokens)


def test_stop_string_split_across_an_emoji_is_trimmed(tokenizer: Any) -> None:
    tokens = tokenizer.encode(TEXT)
    generation = TextGeneration(ScriptedTokens([tokens]), tokenizer, _spec(1, ["🚀 wor"]), "r")
    text = "".join(d.text for d in _run(generation))
    assert text == "Hello 😀"


def test_merged_deltas_interleave_prompts_and_stop_on_abort(tokenizer: Any) -> None:
    tokens = tokenizer.encode(TEXT)
    backends = [ScriptedTokens([tokens], pace_s=0.01), ScriptedTokens([tokens], pace_s=0.01)]
    generations = [TextGeneration(b, tokenizer, _spec(1), f"r{i}") for i, b in enumerate(backends)]

    async def until_abort() -> list[int]:
        aborted = asyncio.Event()
        seen = []
        async for index, _ in merged_deltas(generations, aborted):
            seen.append(index)
            if len(seen) == 4:
                aborted.set()
        await asyncio.sleep(0.05)  # the cancelled pumps unwind
        return seen

    seen = asyncio.run(until_abort())
    assert set(seen) == {0, 1}
    assert all(b.closed_early for b in backends)


def test_merged_deltas_closed_mid_wait_leave_no_task_behind(tokenizer: Any) -> None:
    """A client gone while the merge waits for the next token: closing the merge cancels the
    pumps and its own pending wait, so nothing is left for the event loop to destroy."""
    tokens = tokenizer.encode(TEXT)
    backends = [ScriptedTokens([tokens], pace_s=0.5)]
    generations = [TextGeneration(b, tokenizer, _spec(1), f"r{i}") for i, b in enumerate(backends)]

    async def close_mid_wait() -> set[asyncio.Task[Any]]:
        merged = merged_deltas(generations)
        await anext(merged)
        waiting = asyncio.ensure_future(anext(merged))
        await asyncio.sleep(0.05)  # the merge now waits on the queue for the next token
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await merged.aclose()
        await asyncio.sleep(0.01)  # cancelled tasks unwind
        return {task for task in asyncio.all_tasks() if task is not asyncio.current_task()}

    assert asyncio.run(close_mid_wait()) == set()
    assert all(b.closed_early for b in backends)


class HeldAtPlacement(ScriptedTokens):
    """A cluster whose placement waits for ``placed`` before the stream's first token, and
    that records when the placement began and whether the stream was closed."""

    def __init__(self, samples: list[list[int]]) -> None:
        super().__init__(samples)
        self.placing = asyncio.Event()
        self.placed = asyncio.Event()
        self.stream_closed = False

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncGenerator[TokenEvent, None]:
        self.placing.set()
        try:
            await self.placed.wait()
            async for event in super().generate(*args, **kwargs):
                yield event
        finally:
            self.stream_closed = True


def test_a_started_generation_is_placed_before_its_deltas_are_read(tokenizer: Any) -> None:
    """``start`` sends the prompt at once (a streamed response's headers then go out while it
    is placed); ``deltas`` later gives every token once, the first included."""
    tokens = tokenizer.encode(TEXT)
    backend = HeldAtPlacement([tokens])

    async def main() -> list[SampleDelta]:
        generation = TextGeneration(backend, tokenizer, _spec(1), "r")
        generation.start()
        await asyncio.wait_for(backend.placing.wait(), timeout=30)  # before any deltas()
        backend.placed.set()
        deltas = [delta async for delta in generation.deltas()]
        generation.close()  # after deltas(): nothing to do
        return deltas

    deltas = asyncio.run(main())
    assert [t for d in deltas for t in d.token_ids] == tokens
    assert "".join(d.text for d in deltas) == tokenizer.decode(tokens)
    assert backend.stream_closed and not backend.closed_early


@pytest.mark.parametrize("first_token_came", [False, True])
def test_closing_a_started_generation_that_never_streamed_ends_its_request(
    tokenizer: Any, first_token_came: bool
) -> None:
    """A response that ends before it streams (the client left) closes its started
    generations: the cluster's stream is closed (the request aborted), whether its first
    token had come or it was still being placed."""
    backend = HeldAtPlacement([tokenizer.encode(TEXT)])

    async def main() -> None:
        generation = TextGeneration(backend, tokenizer, _spec(1), "r")
        generation.start()
        await asyncio.wait_for(backend.placing.wait(), timeout=30)
        if first_token_came:
            backend.placed.set()
            for _ in range(100):  # let the first token come
                await asyncio.sleep(0)
        generation.close()
        for _ in range(1000):
            if backend.stream_closed:
                return
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert backend.stream_closed
    assert not first_token_came or backend.closed_early


class SlowSecondToken(ScriptedTokens):
    """Its second token comes ``first_gap_s`` after the first (a hand-off), the rest at the
    pace."""

    def __init__(self, samples: list[list[int]], pace_s: float, first_gap_s: float) -> None:
        super().__init__(samples, pace_s=pace_s)
        self.first_gap_s = first_gap_s

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncGenerator[TokenEvent, None]:
        async for event in super().generate(*args, **kwargs):
            yield event
            if event.position == 0:
                await asyncio.sleep(self.first_gap_s)


def test_a_finished_prompt_reports_its_first_gap_apart_from_the_later_ones(
    tokenizer: Any,
) -> None:
    tokens = tokenizer.encode(TEXT)[:6]
    generation = TextGeneration(SlowSecondToken([tokens], 0.005, 0.2), tokenizer, _spec(1), "r")
    _run(generation)
    finished = generation.finished()
    assert finished.first_gap_s is not None and finished.later_gap_s is not None
    assert finished.first_gap_s >= 0.2 > finished.later_gap_s
    tpot = finished.time_per_output_token
    assert tpot is not None
    assert tpot * 5 == pytest.approx(finished.first_gap_s + 4 * finished.later_gap_s)
