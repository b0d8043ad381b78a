"""The offline API, shaped like vLLM's ``LLM`` so users feel at home.

llm = LLM("path/to/hf_dir", dtype="float32", device="cpu")
outs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
outs = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=32))

``tensor_parallel_size=N`` runs the model on N ranks of this machine: rank 0 (the engine, its
scheduler and sampler) in the calling process, ranks 1 .. N-1 in spawned follower processes
(engine/parallel/). They stop on ``close()``, when the LLM is garbage, or at interpreter exit.
On CPU each rank, the calling process included, keeps 1/N of the cores' torch threads.
``enable_expert_parallel=True`` deals a mixture-of-experts model's routed experts out whole
over those ranks instead of splitting each expert's columns (engine/parallel/shard.py).
As with any spawning code, a script that builds one must guard its top level with
``if __name__ == "__main__":``.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import replace
from typing import Any

from engine.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
)
from engine.config_checks import check_configs
from engine.engine_config import CacheConfig, LoadConfig, LoadFormat, ParallelConfig
from engine.kv_cache.budget import KVBudget
from engine.kv_cache.kv_quantization import KVCacheScales, parse_kv_cache_dtype
from engine.llm_engine import LLMEngine, StepResult
from engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from engine.parallel.group import free_port
from engine.parallel.ranks import FollowerProcesses
from engine.sampling import SamplingParams
from engine.scheduler import SchedulerConfig, SchedulingPolicy
from engine.speculative.config import SpeculativeConfig
from engine.tokenizer import bad_words_token_ids, load_tokenizer

Prompt = str | SequenceOf[int]
Conversation = SequenceOf[Mapping[str, Any]]  # chat messages: {"role", "content", ...} each


class LLM:
    def __init__(
        self,
        model: str,
        *,
        dtype: str = "auto",
        device: str | None = None,
        tokenizer: str | None = None,
        skip_tokenizer_init: bool = False,
        load_format: LoadFormat = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        num_kv_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_chunked_prefill: bool = True,
        attention_backend: str = "auto",
        kv_cache_dtype: str = "auto",
        kv_cache_scales: KVCacheScales | None = None,
        kv_offload_gb: float = 0.0,
        linear_backend: str = "auto",
        enforce_eager: bool = False,
        speculative_config: SpeculativeConfig | Mapping[str, Any] | None = None,
        scheduling_policy: SchedulingPolicy = "fcfs",
        async_scheduling: bool = False,
        tensor_parallel_size: int = 1,
        tensor_parallel_timeout_s: float = 60.0,
        enable_expert_parallel: bool = False,
        trust_remote_code: bool = False,
    ) -> None:
        """``tensor_parallel_timeout_s``: the longest rank 0 waits in a collective, so a step
        with a follower that died or hangs fails within it. ``kv_cache_dtype``: auto (the
        model's dtype), fp8_e4m3 (or fp8) or int8 (engine/kv_cache/kv_quantization.py), with
        ``kv_cache_scales`` when given, else the checkpoint's or calibrated ones.
        ``kv_offload_gb``: GiB of host memory per rank that keep the blocks the KV cache evicts
        (docs/kv-offload.md); 0: none. ``trust_remote_code``: a tokenizer that ships as code
        in the model's directory (Kimi K2's) may run it, as vLLM's."""
        if isinstance(speculative_config, Mapping):  # vLLM's dict
            speculative_config = SpeculativeConfig.from_mapping(speculative_config)
        parallel = ParallelConfig(
            tensor_parallel_size,
            timeout_s=tensor_parallel_timeout_s,
            expert_parallel=enable_expert_parallel,
        )
        configs = (
            LoadConfig(
                model,
                dtype,
                device,
                load_format,
                seed,
                max_model_len,
                linear_backend,
                enforce_eager=enforce_eager,
                tokenizer=tokenizer,
                trust_remote_code=trust_remote_code,
            ),
            CacheConfig(
                block_size,
                enable_prefix_caching,
                KVBudget(num_kv_blocks, kv_cache_memory_bytes, gpu_memory_utilization),
                attention_backend,
                parse_kv_cache_dtype(kv_cache_dtype),
                kv_cache_scales,
                kv_offload_gb,
            ),
            SchedulerConfig(
                max_num_seqs,
                max_num_batched_tokens,
                enable_chunked_prefill,
                scheduling_policy,
                async_scheduling,
            ),
            speculative_config,
        )
        # the follower ranks' processes (None: one rank, this process)
        self._followers: FollowerProcesses | None = None
        if tensor_parallel_size > 1:
            check_configs(*configs, parallel)  # before any process
            parallel = replace(parallel, port=free_port(parallel.host))
            self._followers = FollowerProcesses.start(*configs, parallel)
        try:
            self.engine = LLMEngine(*configs, parallel)
        except BaseException:
            if self._followers is not None:
                self._followers.stop(grace_s=0.0)
            raise
        # stops the followers on close(), when this LLM is garbage, or at interpreter exit
        self._close = weakref.finalize(self, _close_ranks, self.engine, self._followers)
        self._failure: str | None = None  # why the ranks can no longer step
        self.tokenizer = (
            None if skip_tokenizer_init else load_tokenizer(tokenizer or model, trust_remote_code)
        )
        self._request_ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | SequenceOf[Prompt],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        priority: SequenceOf[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished RequestOutput per prompt, in order.
        ``priority``: one per prompt (lower runs first), under the scheduling policy
        "priority" (vLLM's)."""
        prompt_list = _as_prompt_list(prompts)
        texts = [prompt if isinstance(prompt, str) else None for prompt in prompt_list]
        token_ids = [self._encode(prompt) for prompt in prompt_list]
        return self._run(token_ids, texts, sampling_params, priority)

    def beam_search(
        self, prompts: Prompt | SequenceOf[Prompt | Mapping[str, Any]], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """The ``params.beam_width`` best continuations of every prompt (text, token ids, or
        vLLM's ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``), best first, as
        transformers' ``generate(num_beams=...)`` finds them (engine/beam_search.py). Every
        running beam of every prompt is one request a step, its prompt the last one's plus a
        token, which the prefix cache serves. ``max_tokens`` is cut to what ``max_model_len``
        leaves each prompt, as ``generate`` does."""
        if isinstance(prompts, Mapping):
            prompts = [prompts]
        prompt_list = _as_prompt_list(
            [_beam_prompt(p) for p in prompts] if isinstance(prompts, list | tuple) else prompts
        )
        eos = frozenset(self.engine.model_config.eos_token_ids)
        searches = []
        for prompt in prompt_list:
            token_ids = self._encode(prompt)
            room = self.engine.max_model_len - len(token_ids)
            fitted = replace(params, max_tokens=max(1, min(params.max_tokens, room)))
            searches.append(BeamSearch(token_ids, fitted, eos))
        while running := [search for search in searches if not search.done]:
            pending = [(search, ids) for search in running for ids in search.pending()]
            one_token = SamplingParams(
                temperature=0.0, max_tokens=1, logprobs=running[0].candidates_per_beam
            )
            asks = [ids for _, ids in pending]
            outputs = self._run(asks, [None] * len(pending), one_token, None, detokenize=False)
            positions = iter(_first_position(output) for output in outputs)
            for search in running:
                search.advance([next(positions) for _ in search.pending()])
        return [BeamSearchOutput(self._beam_texts(search)) for search in searches]

    def _beam_texts(self, search: BeamSearch) -> list[BeamSearchSequence]:
        """The search's best sequences with their text (as vLLM's: prompt and output; the
        eos that ended one shown only under ``include_stop_str_in_output``)."""
        sequences = search.best()
        if self.tokenizer is None:
            return sequences
        include_stop = search.params.include_stop_str_in_output
        for sequence in sequences:
            shown = search.prompt_token_ids + sequence.shown_token_ids(include_stop)
            sequence.text = self.tokenizer.decode(shown, skip_special_tokens=True)
            self._decode_logprobs(sequence.logprobs)  # (the asks' were left undecoded)
        return sequences

    def chat(
        self,
        messages: Conversation | SequenceOf[Conversation],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate a reply to each conversation (one list of messages, or a list of them), as
        vLLM's ``LLM.chat``: its prompt is the tokenizer's chat template rendered with the
        options given (``tools`` and ``chat_template_kwargs`` as the template's variables), its
        tokens those of the rendered text with no special tokens added; one finished
        RequestOutput per conversation, in order, its ``prompt`` the rendered text."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (this LLM was built without one)")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; use generate")
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        conversations = _as_conversation_list(messages)
        extra = {"tools": tools} if tools else {}
        texts: list[str | None] = [
            self.tokenizer.apply_chat_template(
                list(conversation),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **extra,
                **(chat_template_kwargs or {}),
            )
            for conversation in conversations
        ]
        token_ids = [list(self.tokenizer.encode(text, add_special_tokens=False)) for text in texts]
        return self._run(token_ids, texts, sampling_params, None)

    def _run(
        self,
        prompts_token_ids: list[list[int]],
        texts: list[str | None],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None,
        priority: SequenceOf[int] | None,
        *,
        detokenize: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (its token ids, and its text where it was given as one);
        ``detokenize`` False: the outputs' text and logprobs' tokens are left undecoded."""
        params_list = self._params_per_prompt(sampling_params, len(prompts_token_ids))
        num_prompts = len(prompts_token_ids)
        if priority is not None and len(priority) != num_prompts:
            raise ValueError(f"priority has {len(priority)} entries for {num_prompts} prompts")
        priorities = [0] * num_prompts if priority is None else list(priority)
        request_ids: list[str] = []
        finished: dict[str, RequestOutput] = {}
        try:
            for token_ids, text, params, rank in zip(
                prompts_token_ids, texts, params_list, priorities, strict=True
            ):
                request_id = str(next(self._request_ids))
                params = self._with_bad_words_token_ids(params)
                self.engine.add_request(request_id, token_ids, params, prompt=text, priority=rank)
                request_ids.append(request_id)
            mine = set(request_ids)  # the engine may hold others' requests too
            while len(finished) < len(request_ids):
                step = self._step()
                if not step.new_tokens and not step.finished and not self.engine.scheduler.running:
                    raise RuntimeError(
                        "the scheduler admitted nothing although requests are waiting"
                    )
                finished.update((o.request_id, o) for o in step.finished if o.request_id in mine)
        except BaseException:  # bad input, a failed step, Ctrl-C: leave the engine empty
            for request_id in request_ids:
                if request_id not in finished:
                    self.engine.abort_request(request_id)
            raise
        outputs = [finished[rid] for rid in request_ids]
        if not detokenize:
            return outputs
        return [self._detokenized(output, p) for output, p in zip(outputs, params_list)]

    def close(self) -> None:
        """Stop the follower ranks (nothing with one rank); the LLM cannot generate afterwards.
        Idempotent."""
        self._close()
        self._failure = self._failure or "the LLM is closed"

    @property
    def follower_pids(self) -> list[int]:
        """The process ids of the follower ranks, rank 1 first (empty with one rank)."""
        return [] if self._followers is None else self._followers.pids

    def _step(self) -> StepResult:
        """One engine step; a failed collective is reported with the followers that exited."""
        if self._failure is not None:
            raise RuntimeError(f"the tensor-parallel ranks cannot step: {self._failure}")
        try:
            return self.engine.step()
        except (ConnectionError, TimeoutError) as exc:
            if self._followers is None:
                raise
            exited = self._followers.exited(wait_s=1.0) or ["every follower is still running"]
            self._failure = f"{'; '.join(exited)} ({type(exc).__name__}: {exc})"
            self._close()
            raise RuntimeError(f"a tensor-parallel step failed: {self._failure}") from exc

    def _encode(self, prompt: Prompt) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError("prompt is text but no tokenizer is loaded; pass token ids instead")
        return list(self.tokenizer.encode(prompt))

    def _with_bad_words_token_ids(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its ``bad_words`` text tokenized as vLLM does, into a copy's
        ``bad_words_token_ids`` (the engine reads only ids)."""
        if not params.bad_words or params.bad_words_token_ids:
            return params
        if self.tokenizer is None:
            raise ValueError("bad_words is text but no tokenizer is loaded; pass token ids instead")
        token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        return replace(params, bad_words_token_ids=token_ids)

    def _detokenized(self, output: RequestOutput, params: SamplingParams) -> RequestOutput:
        if self.tokenizer is None:
            return output
        positions = [p for p in output.prompt_logprobs or [] if p is not None]
        for completion in output.outputs:
            completion.text = self._completion_text(completion, params)
            positions += completion.logprobs or []
        self._decode_logprobs(positions)
        return output

    def _decode_logprobs(self, positions: SequenceOf[PositionLogprobs]) -> None:
        """Each position's logprobs, in place, with their token's text."""
        assert self.tokenizer is not None
        for position in positions:
            for token_id, logprob in position.items():
                decoded = self.tokenizer.decode([token_id])
                position[token_id] = replace(logprob, decoded_token=decoded)

    def _completion_text(self, completion: CompletionOutput, params: SamplingParams) -> str:
        """The text a client of the gateway reads for these tokens (router/gateway/text_stream):
        the eos or stop id that ended the sample is not shown, nor a character that the end
        cut short (as vLLM does); both are still in ``token_ids``."""
        assert self.tokenizer is not None
        token_ids = completion.token_ids
        if completion.finish_reason == "stop":  # only eos or a stop id ends a sample so
            token_ids = token_ids[:-1]
        text = self.tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)
        return text.rstrip("\ufffd")

    @staticmethod
    def _params_per_prompt(
        params: SamplingParams | SequenceOf[SamplingParams] | None, num_prompts: int
    ) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * num_prompts
        if isinstance(params, SamplingParams):
            return [params] * num_prompts
        params_list = list(params)
        if len(params_list) != num_prompts:
            raise ValueError(
                f"sampling_params has {len(params_list)} entries but there are "
                f"{num_prompts} prompts; pass one SamplingParams or one per prompt"
            )
        return params_list


def _as_prompt_list(prompts: Any) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompt_list = list(prompts)
    if prompt_list and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_list):
        return [prompt_list]  # a single prompt given as token ids
    for index, prompt in enumerate(prompt_list):
        if not isinstance(prompt, str) and not isinstance(prompt, list | tuple):
            raise ValueError(
                f"prompts[{index}] must be a string or a list of token ids, "
                f"got {type(prompt).__name__}"
            )
    return prompt_list


def _first_position(output: RequestOutput) -> PositionLogprobs:
    logprobs = output.outputs[0].logprobs
    assert logprobs, "a one-token request asked for logprobs returned none"
    return logprobs[0]


def _beam_prompt(prompt: Any) -> Any:
    """vLLM's prompt dicts (``prompt`` or ``prompt_token_ids``) as a plain prompt."""
    if not isinstance(prompt, Mapping):
        return prompt
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if "prompt" in prompt:
        return prompt["prompt"]
    raise ValueError("a prompt given as a mapping needs 'prompt' or 'prompt_token_ids'")


def _as_conversation_list(messages: Any) -> list[Conversation]:
    """One conversation (a list of message mappings) or a list of them, as a list of them."""
    conversations = list(messages)
    if not conversations:
        raise ValueError("messages must hold a conversation (a list of messages)")
    if all(isinstance(message, Mapping) for message in conversations):
        return [conversations]  # a single conversation
    for index, conversation in enumerate(conversations):
        if isinstance(conversation, str | Mapping) or not all(
            isinstance(message, Mapping) for message in conversation
        ):
            raise ValueError(
                f"messages[{index}] must be a conversation: a list of messages, each a mapping "
                "with 'role' and 'content'"
            )
    return conversations


def _close_ranks(engine: LLMEngine, followers: FollowerProcesses | None) -> None:
    """Tell the followers to stop, then wait for their processes (terminating laggards)."""
    engine.close()
    if followers is not None:
        followers.stop()
