"""The engine of one worker: requests in, a step at a time, outputs out.

A request's life: add_request (validated, queued as one sequence) -> step() after step() (the
scheduler picks tokens, the runner computes and samples, the scheduler applies the results)
-> a finished RequestOutput (or abort_request at any point).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.selector import get_attention_backend
from engine.engine_config import CacheConfig, LoadConfig
from engine.kv_cache.block_manager import BlockManager
from engine.kv_cache.budget import KVLayout, num_kv_blocks
from engine.memory_profile import peak_activation_bytes
from engine.model_config import ModelConfig, load_model_config
from engine.model_loader import load_model
from engine.model_runner import ModelRunner
from engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from engine.sampling import SamplingParams, TokenLogprobs
from engine.scheduler import Scheduler, SchedulerConfig, Sequence


@dataclass(frozen=True, slots=True)
class TokenDelta:
    request_id: str
    sample_index: int  # which of the request's n samples
    token_id: int  # the token generated this step
    finish_reason: str | None  # set when this token ended the sample


@dataclass(frozen=True, slots=True)
class StepResult:
    new_tokens: list[TokenDelta]  # one per sample that got a token this step
    finished: list[RequestOutput]  # requests that completed this step


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_generated_tokens: int = 0
    step_seconds: float = 0.0  # wall time of step() calls that ran the model
    forward_seconds: float = 0.0  # of which model forward + logits

    @property
    def overhead_fraction(self) -> float:
        """Share of step time spent outside the model forward (scheduling, inputs, sampling)."""
        return 1.0 - self.forward_seconds / self.step_seconds if self.step_seconds else 0.0


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prompt: str | None
    params: SamplingParams
    seqs: list[Sequence]  # index = sample index; children appear at the fork
    logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)  # by sample index
    arrival_time: float = 0.0


class LLMEngine:
    def __init__(self, load: LoadConfig, cache: CacheConfig, scheduler: SchedulerConfig) -> None:
        self.model_config: ModelConfig = load_model_config(load.model_dir)
        self.device = load.torch_device()
        self.dtype = load.torch_dtype(self.model_config.checkpoint_dtype)
        model_max = self.model_config.max_position_embeddings
        if load.max_model_len is not None and load.max_model_len > model_max:
            raise ValueError(
                f"max_model_len ({load.max_model_len}) must be <= the model's "
                f"max_position_embeddings ({model_max})"
            )
        self.max_model_len = load.max_model_len or model_max
        if (
            not scheduler.enable_chunked_prefill
            and scheduler.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                f"max_num_batched_tokens ({scheduler.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when chunked prefill is disabled"
            )
        torch.manual_seed(load.seed)
        self.model = load_model(
            load.model_dir, self.model_config, self.dtype, self.device, load.load_format, load.seed
        )
        layout = KVLayout(
            num_layers=self.model_config.num_layers,
            num_kv_heads=self.model_config.num_kv_heads,
            head_dim=self.model_config.head_dim,
            block_size=cache.block_size,
            dtype=self.dtype,
        )
        attn_backend = get_attention_backend(cache.attention_backend)
        num_blocks = self._num_kv_blocks(cache, scheduler, layout, attn_backend)
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = torch.zeros(layout.shape(num_blocks), dtype=self.dtype, device=self.device)
        eos = frozenset(self.model_config.eos_token_ids)
        self.block_manager = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(scheduler, self.block_manager, eos)
        self.runner = ModelRunner(
            self.model,
            self.kv_cache,
            attn_backend,
            eos,
            self.device,
        )
        self.stats = EngineStats()
        self._requests: dict[str, _RequestState] = {}

    # ---- requests -----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: SequenceOf[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Validate and queue a request; raises ValueError naming the bad field."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        token_ids = self._validated_prompt(prompt_token_ids)
        self._validate_token_ids("stop_token_ids", params.stop_token_ids)
        max_total = self.max_model_len
        if params.max_tokens is not None:
            max_total = min(max_total, len(token_ids) + params.max_tokens)
        seq = Sequence(
            self.scheduler.new_seq_id(),
            request_id,
            token_ids,
            params,
            max_total,
            seed=params.seed,
            cache_salt=cache_salt,
        )
        self.scheduler.add(seq)
        self._requests[request_id] = _RequestState(
            request_id, prompt, params, [seq], arrival_time=time.monotonic()
        )

    def abort_request(self, request_id: str) -> None:
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        for seq in self.scheduler.abort(request_id):
            self.runner.forget(seq.seq_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ---- stepping -----------------------------------------------------------------------
    def step(self) -> StepResult:
        """Run one scheduling step: the tokens it produced and the requests it finished."""
        started = time.perf_counter()
        output = self.scheduler.schedule()
        if output.is_empty:
            return StepResult([], [])
        result = self.runner.execute(output)
        updated = self.scheduler.update(output, result)
        new_tokens: list[TokenDelta] = []
        touched: dict[str, _RequestState] = {}
        for seq in updated:
            state = self._requests[seq.request_id]
            if seq.sample_index >= len(state.seqs):
                state.seqs.append(seq)
            token_logprobs = result.logprobs.get(seq.seq_id)
            if token_logprobs is not None:
                state.logprobs.setdefault(seq.sample_index, []).append(token_logprobs)
            new_tokens.append(
                TokenDelta(seq.request_id, seq.sample_index, seq.token_ids[-1], seq.finish_reason)
            )
            touched[state.request_id] = state
        finished = [self._finish(state) for state in touched.values() if _is_done(state)]
        self.stats.num_steps += 1
        self.stats.num_generated_tokens += len(updated)
        self.stats.forward_seconds += result.forward_seconds
        self.stats.step_seconds += time.perf_counter() - started
        return StepResult(new_tokens, finished)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # ---- helpers ------------------------------------------------------------------------
    def _num_kv_blocks(
        self,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        layout: KVLayout,
        attn_backend: AttentionBackend,
    ) -> int:
        activation_bytes = 0
        if cache.budget.num_blocks is None and cache.budget.memory_bytes is None:
            activation_bytes = peak_activation_bytes(
                self.model,
                layout,
                attn_backend,
                self.device,
                max_num_batched_tokens=scheduler.max_num_batched_tokens,
                max_num_seqs=scheduler.max_num_seqs,
                max_model_len=self.max_model_len,
                vocab_size=self.model_config.vocab_size,
            )
        return num_kv_blocks(cache.budget, layout, self.device, activation_bytes)

    def _finish(self, state: _RequestState) -> RequestOutput:
        del self._requests[state.request_id]
        for seq in state.seqs:
            self.runner.forget(seq.seq_id)
        return self._make_output(state)

    def _validated_prompt(self, prompt_token_ids: SequenceOf[int]) -> list[int]:
        token_ids = list(prompt_token_ids)
        if not token_ids:
            raise ValueError("prompt must contain at least 1 token")
        self._validate_token_ids("prompt_token_ids", token_ids)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens long; it must be shorter than max_model_len "
                f"({self.max_model_len}) to leave room for at least one output token"
            )
        return token_ids

    def _validate_token_ids(self, field_name: str, token_ids: SequenceOf[int]) -> None:
        vocab_size = self.model_config.vocab_size
        for token in token_ids:
            if isinstance(token, bool) or not isinstance(token, int):
                raise ValueError(f"{field_name} must hold ints, got {type(token).__name__}")
            if not 0 <= token < vocab_size:
                raise ValueError(
                    f"{field_name} holds token id {token}, outside the vocabulary [0, {vocab_size})"
                )

    def _make_output(self, state: _RequestState) -> RequestOutput:
        completions = []
        for seq in state.seqs:
            token_lps = state.logprobs.get(seq.sample_index)
            completions.append(
                CompletionOutput(
                    index=seq.sample_index,
                    text="",
                    token_ids=seq.output_token_ids,
                    cumulative_logprob=(
                        sum(lp.sampled_logprob for lp in token_lps) if token_lps else None
                    ),
                    logprobs=[_position_logprobs(lp) for lp in token_lps] if token_lps else None,
                    finish_reason=seq.finish_reason,
                )
            )
        finished = _is_done(state)
        parent = state.seqs[0]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=parent.num_cached_prompt_tokens,
        )


def _is_done(state: _RequestState) -> bool:
    return len(state.seqs) == state.params.n and all(s.is_finished for s in state.seqs)


def _position_logprobs(lp: TokenLogprobs) -> PositionLogprobs:
    position = {
        token: Logprob(logprob, rank)
        for rank, (token, logprob) in enumerate(zip(lp.top_token_ids, lp.top_logprobs), start=1)
    }
    position.setdefault(lp.sampled_token_id, Logprob(lp.sampled_logprob, lp.sampled_rank))
    return position
