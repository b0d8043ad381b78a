"""A spec's token events turned into text deltas per sample: what both front doors stream.

Life of one prompt here: the spec goes to the cluster -> token events come back in order per
sample -> each sample's tokens are detokenized incrementally (never a broken character) and
checked for stop strings (held back while they might be one; trimmed when matched; an eos or
``stop_token_ids`` token that ends a sample is counted but not shown, as vLLM does; with vLLM's
``include_stop_str_in_output`` both are shown and nothing is held back) -> a ``SampleDelta``
leaves for each token as it arrives, as vLLM streams them, its text possibly empty (a special
token skipped, an eos under ``ignore_eos``, or text held back: part of a character, or what may
begin a stop string, which leaves with the delta of the token that completes it, or with the
sample's last). When every sample has ended, leaving the cluster's stream aborts whatever still
runs (a sample cut by a stop string).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.messages import FirstTokenTrace, TokenEvent
from engine.sampling.messages import PromptTokenLogprobs, TokenLogprobs
from engine.sampling.params import SamplingParams
from router.detokenizer import IncrementalDetokenizer, StopStringMatcher
from router.gateway.errors import refused
from router.gateway.prompt_logprobs import ScoredPrompt, scored_prompt
from router.gateway.spec import GenerationSpec
from router.latency_forecast import AllowedWorkers, Forecast

_REPLACEMENT = "\ufffd"  # what a partial UTF-8 sequence decodes to


class GenerationBackend(Protocol):
    """What the front doors need from the cluster (``router.cluster.Cluster`` is one)."""

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        allowed: AllowedWorkers | None = None,
    ) -> AsyncGenerator[TokenEvent, None]:
        """``allowed``: the workers to place it among (admission's; None: any). Raises
        ValueError for a request the workers refuse (e.g. ``n`` above their max_num_seqs),
        possibly as a Ray task error that wraps it."""
        ...


class TokenTimingObserver(Protocol):
    """Receives latencies as tokens arrive (the gateway's metrics)."""

    def first_token(self, seconds: float) -> None: ...
    def next_token(self, seconds: float) -> None: ...


@dataclass(frozen=True, slots=True)
class SampleDelta:
    index: int  # the sample (0 .. n-1) of its prompt
    text: str  # newly final text: no partial characters, stop strings trimmed (unless kept)
    token_ids: list[int]  # the token behind it (one)
    logprobs: list[TokenLogprobs]  # its logprobs when the request asked for them
    finish_reason: str | None  # "stop" | "length" | "abort" on the sample's last delta
    # vLLM's stop_reason, on the last delta: the stop string or stop token id that ended the
    # sample; None for anything else (the tokenizer's eos, max_tokens, an abort)
    stop_reason: str | int | None = None


@dataclass(slots=True)
class _Sample:
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    num_tokens: int = 0  # tokens counted in usage (up to the one that completed a stop string)
    finished: bool = False
    first_token_at: float | None = None  # monotonic arrival time of the sample's first token
    second_token_at: float | None = None  # ... of its second one
    last_token_at: float = 0.0  # ... and of its latest one


@dataclass(frozen=True, slots=True)
class FinishedGeneration:
    """What the metrics record of one prompt's generation once it ended."""

    e2e_seconds: float  # arrival at the gateway to the prompt's last token
    queue_seconds: float  # waiting at the first worker before its first step
    time_to_first_token: float | None  # arrival to sample 0's first token; None: no token
    time_per_output_token: float | None  # mean gap between sample 0's later tokens (0 for one)
    num_prompt_tokens: int
    num_completion_tokens: int  # over all samples
    # the latencies predicted at admission, on the placement it got
    forecast: Forecast | None = None
    # sample 0's gap between its first and second token (disaggregated: across the hand-off;
    # None under two tokens), and the mean of its gaps after that (None under three)
    first_gap_s: float | None = None
    later_gap_s: float | None = None


@dataclass(slots=True)
class TextGeneration:
    """One prompt's generation; iterate ``deltas()`` once, then read the usage counters."""

    backend: GenerationBackend
    tokenizer: Any
    spec: GenerationSpec
    request_id: str
    timing: TokenTimingObserver | None = None
    arrived_at: float = field(default_factory=time.monotonic)  # when the request reached the
    # front door, before its body was read and parsed: TTFT and e2e count from here
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served
    queue_seconds: float = 0.0  # waiting at the first worker before its first step
    # the prompt's logprobs (positions 1 ..), once the first token brought them; None until
    # then, or when the spec's params do not ask for them
    prompt_logprobs: PromptTokenLogprobs | None = None
    # the first token's trace as the cluster yielded it (the gateway completes and records
    # it); None until then, or when it came untraced
    first_token_trace: FirstTokenTrace | None = None
    # its latencies as the router predicted them at admission (None: no prediction)
    forecast: Forecast | None = None
    # the workers admission allows it (those predicted to make its SLOs; None: any)
    allowed: AllowedWorkers | None = None
    _samples: list[_Sample] = field(default_factory=list, init=False)
    # the cluster's stream and the task taking its first event, once ``start`` sent the prompt
    # ahead of ``deltas``; None before, and once ``deltas`` or ``close`` took them
    _started: tuple[AsyncGenerator[TokenEvent, None], asyncio.Future[TokenEvent]] | None = field(
        default=None, init=False
    )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.spec.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        """Tokens generated so far, over all samples (up to the ones that hit stop strings)."""
        return sum(s.num_tokens for s in self._samples)

    def start(self) -> None:
        """Send the prompt to the cluster now (on the event loop), ahead of ``deltas()``: a
        streamed response's headers then go out while the prompt is placed, rather than before
        it. Call it before ``deltas()``, which takes the stream over; ``close()`` ends it if
        ``deltas()`` never runs."""
        if self._started is None:
            events = self._cluster_events()
            self._started = (events, asyncio.ensure_future(anext(events)))

    def close(self) -> None:
        """End a generation that ``start`` sent and whose ``deltas()`` never ran (its response
        ended before it streamed): the request is aborted in the cluster. Nothing otherwise."""
        started, self._started = self._started, None
        if started is None:
            return
        events, first = started
        first.cancel()  # a placement under way: aborted once placed
        # then the stream itself (it cannot be closed while the first event is being taken)
        first.add_done_callback(lambda taken: _drop(taken, events))

    async def deltas(self) -> AsyncIterator[SampleDelta]:
        params = self.spec.params
        self._samples = samples = [
            _Sample(
                IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
                StopStringMatcher(self.spec.stop, self.spec.include_stop_str_in_output),
            )
            for _ in range(params.n)
        ]
        started, self._started = self._started, None
        if started is None:
            events, first = self._cluster_events(), None
        else:
            events, first = started
        try:
            async with contextlib.aclosing(_resumed(first, events)) as stream:
                async for event in stream:
                    if event.position == 0 and event.sample_index == 0:
                        self.num_cached_tokens = event.num_cached_tokens
                        self.queue_seconds = event.queue_seconds
                        self.first_token_trace = event.first_token_trace
                    if event.prompt_logprobs is not None:  # once, with sample 0's first token
                        self.prompt_logprobs = event.prompt_logprobs
                    self._time(samples[event.sample_index], event.sample_index)
                    delta = self._advance(samples[event.sample_index], event)
                    if delta is not None:
                        yield delta
                    if all(s.finished for s in samples):
                        break
        except ValueError as error:  # the workers refused it: a client error, not a failure
            raise refused(error) from error
        finally:
            if first is not None and not first.done():
                first.cancel()  # left while the first event was awaited: it stops the stream
                await asyncio.wait([first])
            await events.aclose()  # aborts the request wherever it still runs

    def _cluster_events(self) -> AsyncGenerator[TokenEvent, None]:
        return self.backend.generate(
            self.spec.prompt_token_ids,
            self.spec.params,
            request_id=self.request_id,
            cache_salt=self.spec.cache_salt,
            priority=self.spec.priority,
            allowed=self.allowed,
        )

    def scored_prompt(self) -> ScoredPrompt:
        """The prompt with the logprobs the workers sent for it; a RuntimeError (a server
        fault) when the params asked for them and none came with the first token."""
        return scored_prompt(self.spec.prompt_token_ids, self.prompt_logprobs)

    def finished(self) -> FinishedGeneration:
        """The prompt's latencies, its end being its last sample's last token (the time it
        finished, not the time the whole request did)."""
        first = self._samples[0] if self._samples else None
        ttft = tpot = first_gap = later_gap = None
        if first is not None and first.first_token_at is not None:
            ttft = first.first_token_at - self.arrived_at
            gaps = first.num_tokens - 1
            tpot = (first.last_token_at - first.first_token_at) / gaps if gaps > 0 else 0.0
            if first.second_token_at is not None:
                first_gap = first.second_token_at - first.first_token_at
                if gaps > 1:
                    later_gap = (first.last_token_at - first.second_token_at) / (gaps - 1)
        ended_at = max((s.last_token_at for s in self._samples), default=0.0)
        return FinishedGeneration(
            (ended_at or time.monotonic()) - self.arrived_at,
            self.queue_seconds,
            ttft,
            tpot,
            self.num_prompt_tokens,
            self.num_completion_tokens,
            self._placed_forecast(),
            first_gap,
            later_gap,
        )

    def _placed_forecast(self) -> Forecast | None:
        """The forecast of the placement the prompt got (its first token's trace names it)."""
        trace = self.first_token_trace
        if self.forecast is None or trace is None:
            return self.forecast
        return self.forecast.placed_on(trace.worker_id, trace.decode_worker_id)

    def _time(self, sample: _Sample, sample_index: int) -> None:
        if sample.finished:
            return
        now = time.monotonic()
        if sample.first_token_at is None:
            sample.first_token_at = now
            if self.timing is not None and sample_index == 0:
                self.timing.first_token(now - self.arrived_at)
        else:
            if sample.second_token_at is None:
                sample.second_token_at = now
            if self.timing is not None:
                self.timing.next_token(now - sample.last_token_at)
        sample.last_token_at = now

    def _advance(self, sample: _Sample, event: TokenEvent) -> SampleDelta | None:
        if sample.finished:
            return None  # a stop string ended it; the cluster is still winding it down
        sample.num_tokens += 1
        # an eos or stop_token_ids token ended it: counted, but shown only with
        # include_stop_str_in_output (as vLLM does; an eos is a special token, shown only with
        # skip_special_tokens false)
        hidden = event.finish_reason == "stop" and not sample.stops.include_in_output
        shown = "" if hidden else sample.detokenizer.push(event.token_id)
        text = sample.stops.feed(shown)
        finish_reason = "stop" if sample.stops.stopped else event.finish_reason
        if finish_reason is not None and not sample.stops.stopped:
            text += sample.stops.feed(_whole_characters(sample.detokenizer.flush()))
            text += sample.stops.flush()
            finish_reason = "stop" if sample.stops.stopped else finish_reason
        sample.finished = finish_reason is not None
        logprobs = [] if event.logprobs is None else [event.logprobs]
        stop_reason = self._stop_reason(sample, event) if finish_reason == "stop" else None
        return SampleDelta(
            event.sample_index, text, [event.token_id], logprobs, finish_reason, stop_reason
        )

    def _stop_reason(self, sample: _Sample, event: TokenEvent) -> str | int | None:
        """What ended a sample that stopped, as vLLM reports it: the stop string matched, else
        the token that ended it unless that is the tokenizer's eos (generation_config's other
        eos ids are stop tokens in vLLM, reported by id)."""
        if sample.stops.matched is not None:
            return sample.stops.matched
        if event.token_id == self.tokenizer.eos_token_id and not self.spec.params.ignore_eos:
            return None
        return event.token_id


def _whole_characters(text: str) -> str:
    """``text`` without the replacement characters that a character cut short by the end of
    the sample (max_tokens inside an emoji) decodes to: never a U+FFFD at the end, as vLLM."""
    return text.rstrip(_REPLACEMENT)


def _drop(first: asyncio.Future[TokenEvent], events: AsyncGenerator[TokenEvent, None]) -> None:
    """Close a stream nobody will read, once the task taking its first event is done."""
    if not first.cancelled():
        first.exception()  # (read, so that an error is not reported as never retrieved)
    asyncio.ensure_future(events.aclose())


async def _resumed(
    first: asyncio.Future[TokenEvent] | None, events: AsyncGenerator[TokenEvent, None]
) -> AsyncGenerator[TokenEvent, None]:
    """``events``, after the event ``first`` took from them (if it did: a stream that ended
    before its first event ends here too)."""
    if first is not None:
        try:
            yield await first
        except StopAsyncIteration:
            return
    async for event in events:
        yield event


async def merged_deltas(
    generations: Sequence[TextGeneration], aborted: asyncio.Event | None = None
) -> AsyncGenerator[tuple[int, SampleDelta], None]:
    """(generation index, delta) from several prompts at once, as they come.

    Ends when every generation has ended, or early when ``aborted`` is set. Leaving early
    (abort, client gone, an error) cancels the rest, which aborts them in the cluster.
    """
    queue: asyncio.Queue[tuple[int, SampleDelta | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, generation: TextGeneration) -> None:
        try:
            async for delta in generation.deltas():
                queue.put_nowait((index, delta))
            queue.put_nowait((index, None))
        except Exception as error:  # handed to the consumer, which re-raises it
            queue.put_nowait((index, error))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    abort_wait = asyncio.create_task(aborted.wait()) if aborted is not None else None
    remaining = len(tasks)
    getter: asyncio.Task[tuple[int, SampleDelta | BaseException | None]] | None = None
    try:
        while remaining:
            getter = asyncio.create_task(queue.get())
            waiting = {getter} if abort_wait is None else {getter, abort_wait}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                return
            index, item = getter.result()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        if getter is not None:
            getter.cancel()  # pending when aborted, or when this generator is closed mid-wait
        for task in tasks:
            task.cancel()  # each aborts its request in the cluster as it unwinds
        if abort_wait is not None:
            abort_wait.cancel()
