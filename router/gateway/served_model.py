"""The model a gateway serves: its public name, context length, vocabulary, tokenizer and the
formats its tool calls and its reasoning are read in."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.model_config import load_model_config
from router.gateway.harmony import FINAL_START, HARMONY_PARSER, HARMONY_TOOL_CALL_PARSER
from router.gateway.reasoning import THINK_END, ReasoningMode
from router.gateway.tool_calls import AutoToolCalls

# architectures whose replies are harmony messages: read as such unless told otherwise, as vLLM
_HARMONY_ARCHITECTURES = frozenset({"GptOssForCausalLM"})


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str  # the id clients pass as ``model`` (``--served-model-name``)
    max_model_len: int  # prompt + output tokens per sequence
    vocab_size: int  # token ids must lie in [0, vocab_size)
    tokenizer: Any  # a transformers tokenizer (encode, decode, apply_chat_template)
    eos_token_ids: tuple[int, ...] = ()  # what ends a sample (config and generation config)
    created: int = 0  # unix time the server started (``created`` in /v1/models)
    # its weights' quantization as the checkpoint gives it, e.g. "compressed-tensors w4a16
    # (group 128, symmetric)"; None: float weights
    quantization: str | None = None
    # what its KV cache stores: "fp8_e4m3" or "int8" (a quantized cache), else the model's
    # dtype, e.g. "bfloat16"
    kv_cache_dtype: str = "float32"
    # the format tool_choice "auto" reads the model's calls in (``--tool-call-parser`` with
    # ``--enable-auto-tool-choice``); None: "auto" is refused, as vLLM refuses it without them
    tool_call_parser: str | None = None
    # the format chat output's reasoning is split off in (``--reasoning-parser``; a gpt-oss
    # model's is ``openai_gptoss`` unless given); None: not
    reasoning_parser: str | None = None
    # where the reasoning ends as the tokenizer encodes it (``</think>``; harmony: the final
    # answer's header), an output constraint holding from the next token under a reasoning
    # parser (derived: tokenized once, not per request); () without a parser
    reasoning_end_token_ids: tuple[int, ...] = field(init=False, default=())

    @property
    def harmony(self) -> bool:
        """Whether its chat replies are read as gpt-oss's harmony messages."""
        return self.reasoning_parser == HARMONY_PARSER

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            AutoToolCalls(self.tool_call_parser)  # a ValueError naming the supported ones
        if self.tool_call_parser == HARMONY_TOOL_CALL_PARSER and not self.harmony:
            raise ValueError(
                f"--tool-call-parser {HARMONY_TOOL_CALL_PARSER} reads gpt-oss's harmony "
                f"messages: it needs --reasoning-parser {HARMONY_PARSER} (a gpt_oss model's "
                f"default); this server's is {self.reasoning_parser}"
            )
        if self.reasoning_parser is not None:
            ReasoningMode(self.reasoning_parser)  # a ValueError naming the supported ones
            end_text = FINAL_START if self.harmony else THINK_END
            end = tuple(self.tokenizer.encode(end_text, add_special_tokens=False))
            object.__setattr__(self, "reasoning_end_token_ids", end)

    @classmethod
    def load(
        cls,
        model_dir: str,
        name: str | None,
        max_model_len: int | None,
        created: int = 0,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        dtype: str = "auto",  # the workers' (LoadConfig.dtype)
        device: str = "cpu",  # the workers' device type (cpu | cuda)
        kv_cache_dtype: str = "auto",  # the workers' (CacheConfig.kv_cache_dtype)
        trust_remote_code: bool = False,  # (LoadConfig.trust_remote_code)
    ) -> ServedModel:
        from engine.engine_config import LoadConfig
        from engine.kv_cache.kv_quantization import is_quantized
        from engine.tokenizer import load_tokenizer

        config = load_model_config(model_dir)
        if max_model_len is not None and max_model_len > config.max_position_embeddings:
            raise ValueError(
                f"--max-model-len ({max_model_len}) must be <= the model's "
                f"max_position_embeddings ({config.max_position_embeddings})"
            )
        tokenizer = load_tokenizer(model_dir, trust_remote_code)
        if tokenizer is None:
            raise ValueError(f"no tokenizer in {model_dir}: the gateway needs one")
        # The first encode turns off any truncation or padding the tokenizer file sets: the one
        # change to a fast tokenizer's state, done before threads share it (parsers encode
        # while the event loop decodes; a change during either raises "Already borrowed").
        tokenizer.encode("warm-up")
        if reasoning_parser is None and config.architecture in _HARMONY_ARCHITECTURES:
            reasoning_parser = HARMONY_PARSER
        return cls(
            name=name or Path(model_dir).resolve().name,
            max_model_len=max_model_len or config.max_position_embeddings,
            vocab_size=config.vocab_size,
            tokenizer=tokenizer,
            eos_token_ids=config.eos_token_ids,
            created=created,
            quantization=None if config.quantization is None else config.quantization.describe(),
            kv_cache_dtype=kv_cache_dtype
            if is_quantized(kv_cache_dtype)
            else LoadConfig(model_dir, dtype).dtype_name(config.checkpoint_dtype, device),
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
        )
