"""`SamplingParams`: how one request wants its tokens chosen, validated once at construction.

Shaped like vLLM's class of the same name, so ``SamplingParams(temperature=0.7, top_p=0.9)``
reads the same here. Every field is checked when the object is built; a bad value, a wrong type
or an unknown keyword raises ``ValueError`` naming the field and the limit. The object is frozen
afterwards, so the engine can share it between the scheduler, workers and the sampler.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.structured.spec import StructuredOutputSpec

GREEDY_TEMPERATURE_EPS = 1e-5  # temperatures below this mean greedy (argmax) decoding
MAX_LOGPROBS = 20  # the most top-N logprobs a request may ask for
MAX_PENALTY = 2.0  # presence/frequency penalties live in [-MAX_PENALTY, MAX_PENALTY]
# Logits are divided or multiplied by the repetition penalty in float32: far outside these
# bounds they overflow to inf (or the penalty itself rounds to 0 or inf), and sampling reads NaN.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-6, 1e6
MAX_LOGIT_BIAS = 100.0  # logit_bias values live in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], as OpenAI's
# The most logit_bias entries one request may hold: each costs a little per row every step, and
# a bound keeps an untrusted client from making that cost the size of the vocabulary.
MAX_LOGIT_BIAS_ENTRIES = 1024
# Bad words bounds, as vLLM v1's GPU sampler (``vllm/v1/worker/gpu/sample/bad_words.py``): at
# most this many token sequences per request, holding at most this many token ids in all.
MAX_NUM_BAD_WORDS = 128
MAX_BAD_WORDS_TOTAL_TOKENS = 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    n: int = 1  # parallel samples per prompt
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens with mass >= top_p
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 disables it
    min_p: float = 0.0  # drop tokens with prob < min_p * (prob of the most likely token)
    repetition_penalty: float = 1.0  # HF rule over prompt + output tokens; 1 disables it
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    # token id -> bias added to its logit before penalties and sampling (greedy too); each in
    # [-100, 100], at most MAX_LOGIT_BIAS_ENTRIES; stored as a LogitBias (immutable), {} as None
    logit_bias: Mapping[int, float] | None = None
    # only these token ids may be sampled (every other logit -> -inf); None allows all. At least
    # one id; stored as a sorted tuple without duplicates
    allowed_token_ids: Sequence[int] | None = None
    # vLLM's bad words, as text: ``LLM.generate`` tokenizes them into ``bad_words_token_ids``
    # (``engine.tokenizer.bad_words_token_ids``); the engine reads only the ids. Stored as a tuple
    bad_words: Sequence[str] | None = None
    # token sequences never completed in the output: the last id of each is banned whenever the
    # output ends with the others (a one-token sequence is always banned). At most
    # MAX_NUM_BAD_WORDS sequences, MAX_BAD_WORDS_TOTAL_TOKENS ids in all; tuple of tuples
    bad_words_token_ids: Sequence[Sequence[int]] = ()
    seed: int | None = None  # per-request RNG seed; None uses the engine's global RNG
    stop_token_ids: Sequence[int] = ()  # extra ids that end generation (stored as a tuple)
    max_tokens: int | None = 16  # most tokens to generate; None means up to the model's limit
    min_tokens: int = 0  # eos and stop ids are banned until this many tokens exist
    ignore_eos: bool = False  # keep generating past eos
    logprobs: int | None = None  # return the sampled token's logprob plus the top-N (N <= 20)
    # vLLM's prompt logprobs: per prompt position after the first, the prompt token's logprob
    # plus the top-N (N <= 20) given the tokens before it; None: off. vLLM's -1 (the whole
    # vocabulary) is refused
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True  # drop special tokens when detokenizing
    # vLLM's structured outputs: the output must match this JSON schema, JSON object, regex or
    # choice (engine.structured); eos is allowed only where it does. Not with ignore_eos
    structured_outputs: StructuredOutputSpec | None = None

    def __new__(cls, *args: object, **kwargs: object) -> SamplingParams:
        # Runs before the generated __init__, so bad keywords get a ValueError, not a TypeError.
        if args:
            raise ValueError("SamplingParams takes keyword arguments only")
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(kwargs) - set(valid))
        if unknown:
            raise ValueError(
                f"unknown SamplingParams field(s) {', '.join(unknown)}; "
                f"valid fields are: {', '.join(valid)}"
            )
        return object.__new__(cls)

    def __post_init__(self) -> None:
        n = _as_int("n", self.n)
        _check(n >= 1, "n", "must be >= 1", n)
        temperature = _as_float("temperature", self.temperature)
        _check(temperature >= 0, "temperature", "must be >= 0", temperature)
        top_p = _as_float("top_p", self.top_p)
        _check(0 < top_p <= 1, "top_p", "must be in (0, 1]", top_p)
        top_k = _as_int("top_k", self.top_k)
        _check(top_k >= -1, "top_k", "must be >= -1 (0 or -1 disables it)", top_k)
        min_p = _as_float("min_p", self.min_p)
        _check(0 <= min_p <= 1, "min_p", "must be in [0, 1]", min_p)
        repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        _check(
            MIN_REPETITION_PENALTY <= repetition_penalty <= MAX_REPETITION_PENALTY,
            "repetition_penalty",
            "must be in [1e-6, 1e6]",
            repetition_penalty,
        )
        presence_penalty = _penalty("presence_penalty", self.presence_penalty)
        frequency_penalty = _penalty("frequency_penalty", self.frequency_penalty)
        seed = None if self.seed is None else _as_int("seed", self.seed)
        normalized = {
            "n": n,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
            "repetition_penalty": repetition_penalty,
            "presence_penalty": presence_penalty,
            "frequency_penalty": frequency_penalty,
            "seed": seed,
            "stop_token_ids": _token_ids("stop_token_ids", self.stop_token_ids),
            "logit_bias": _logit_bias(self.logit_bias),
            "allowed_token_ids": _allowed_token_ids(self.allowed_token_ids),
            "bad_words": _bad_words(self.bad_words),
            "bad_words_token_ids": _bad_words_token_ids(self.bad_words_token_ids),
            **self._normalized_lengths(),
            "prompt_logprobs": _prompt_logprobs(self.prompt_logprobs),
            "ignore_eos": _as_bool("ignore_eos", self.ignore_eos),
            "skip_special_tokens": _as_bool("skip_special_tokens", self.skip_special_tokens),
            "structured_outputs": _structured_outputs(self.structured_outputs, self.ignore_eos),
        }
        for name, value in normalized.items():
            object.__setattr__(self, name, value)

    def _normalized_lengths(self) -> dict[str, int | None]:
        max_tokens = None if self.max_tokens is None else _as_int("max_tokens", self.max_tokens)
        if max_tokens is not None:
            _check(max_tokens >= 1, "max_tokens", "must be >= 1 (or None)", max_tokens)
        min_tokens = _as_int("min_tokens", self.min_tokens)
        _check(min_tokens >= 0, "min_tokens", "must be >= 0", min_tokens)
        if max_tokens is not None:
            _check(
                min_tokens <= max_tokens,
                "min_tokens",
                f"must be <= max_tokens ({max_tokens})",
                min_tokens,
            )
        logprobs = None if self.logprobs is None else _as_int("logprobs", self.logprobs)
        if logprobs is not None:
            _check(
                0 <= logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be in [0, {MAX_LOGPROBS}]",
                logprobs,
            )
        return {"max_tokens": max_tokens, "min_tokens": min_tokens, "logprobs": logprobs}

    @property
    def uses_token_history(self) -> bool:
        """Whether sampling reads the prompt and output tokens (repetition/presence/frequency
        penalties, bad words)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or len(self.bad_words_token_ids) > 0
        )

    @property
    def greedy(self) -> bool:
        """True when the temperature is so low that sampling is an argmax."""
        return self.temperature < GREEDY_TEMPERATURE_EPS


class LogitBias(Mapping[int, float]):
    """An immutable, hashable, picklable ``{token id: bias}`` (what ``logit_bias`` is stored as).

    Reads like the dict vLLM keeps (``params.logit_bias[50256]``) and compares equal to one,
    but the frozen ``SamplingParams`` that holds it stays hashable and travels through Ray.
    Iterates in ascending token id order.
    """

    __slots__ = ("_biases", "_pairs")

    def __init__(self, pairs: Mapping[int, float]) -> None:
        self._pairs = tuple(sorted(pairs.items()))  # ((token id, bias), ...) ascending
        self._biases = dict(self._pairs)

    def __getitem__(self, token_id: int) -> float:
        return self._biases[token_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._biases)

    def __len__(self) -> int:
        return len(self._pairs)

    def __hash__(self) -> int:
        return hash(self._pairs)

    def __repr__(self) -> str:
        return f"LogitBias({self._biases!r})"

    def __reduce__(self) -> tuple[type[LogitBias], tuple[dict[int, float]]]:
        return (LogitBias, (self._biases,))


def _check(ok: bool, name: str, limit: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} {limit}, got {value!r}")


def _describe(value: object) -> str:
    return f"{type(value).__name__} ({value!r})"


def _as_int(name: str, value: object, expected: str = "an int") -> int:
    """``value`` as an int; else a ValueError: ``name`` must be ``expected`` (a bool is none)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be {expected}, got {_describe(value)}")
    return int(value)


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {_describe(value)}")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{name} must be finite, got {result!r}")
    return result


def _as_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {_describe(value)}")
    return value


def _structured_outputs(value: object, ignore_eos: object) -> StructuredOutputSpec | None:
    if value is None:
        return None
    from engine.structured.spec import StructuredOutputSpec  # (torch-free)

    if not isinstance(value, StructuredOutputSpec):
        raise ValueError(
            f"structured_outputs must be a StructuredOutputSpec or None, got {type(value).__name__}"
        )
    _check(
        ignore_eos is not True,
        "structured_outputs",
        "cannot be combined with ignore_eos (the output ends where the structure does)",
        value,
    )
    return value


def _prompt_logprobs(value: object) -> int | None:
    if value is None:
        return None
    expected = f"an int in [0, {MAX_LOGPROBS}] or None"
    num_top = _as_int("prompt_logprobs", value, expected)
    if num_top == -1:
        raise ValueError(
            f"prompt_logprobs=-1 (logprobs of the whole vocabulary, as vLLM allows) is not "
            f"supported: prompt_logprobs must be {expected}"
        )
    _check(0 <= num_top <= MAX_LOGPROBS, "prompt_logprobs", f"must be {expected}", num_top)
    return num_top


def _penalty(name: str, value: object) -> float:
    penalty = _as_float(name, value)
    _check(-MAX_PENALTY <= penalty <= MAX_PENALTY, name, "must be in [-2, 2]", penalty)
    return penalty


def _token_ids(name: str, value: object) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a list or tuple of ints, got {_describe(value)}")
    token_ids = tuple(_as_int(f"{name}[{i}]", token_id) for i, token_id in enumerate(value))
    for i, token_id in enumerate(token_ids):
        _check(token_id >= 0, f"{name}[{i}]", "must be >= 0", token_id)
    return token_ids


def _logit_bias(value: object) -> LogitBias | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(
            f"logit_bias must be a mapping of token id -> bias, got {_describe(value)}"
        )
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(
            f"logit_bias must hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(value)}"
        )
    biases: dict[int, float] = {}
    for key, bias in value.items():
        token_id = _as_int("logit_bias keys", key)
        _check(token_id >= 0, "logit_bias keys", "must be token ids >= 0", token_id)
        name = f"logit_bias[{token_id}]"
        biases[token_id] = _as_float(name, bias)
        _check(
            -MAX_LOGIT_BIAS <= biases[token_id] <= MAX_LOGIT_BIAS,
            name,
            "must be in [-100, 100]",
            biases[token_id],
        )
    return LogitBias(biases) if biases else None


def _allowed_token_ids(value: object) -> tuple[int, ...] | None:
    if value is None:
        return None
    token_ids = _token_ids("allowed_token_ids", value)
    if not token_ids:
        raise ValueError(
            f"allowed_token_ids must hold at least 1 token id, got {value!r} "
            "(None allows every token)"
        )
    return tuple(sorted(set(token_ids)))


def _bad_words(value: object) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"bad_words must be a list of strings, got {_describe(value)}")
    if len(value) > MAX_NUM_BAD_WORDS:
        raise ValueError(f"bad_words must hold at most {MAX_NUM_BAD_WORDS} words, got {len(value)}")
    for i, word in enumerate(value):
        if not isinstance(word, str):
            raise ValueError(f"bad_words[{i}] must be a string, got {_describe(word)}")
    return tuple(value) or None


def _bad_words_token_ids(value: object) -> tuple[tuple[int, ...], ...]:
    name = "bad_words_token_ids"
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a list of token id lists, got {_describe(value)}")
    if len(value) > MAX_NUM_BAD_WORDS:
        raise ValueError(
            f"{name} must hold at most {MAX_NUM_BAD_WORDS} sequences, got {len(value)}"
        )
    sequences = tuple(_token_ids(f"{name}[{i}]", ids) for i, ids in enumerate(value))
    for i, ids in enumerate(sequences):
        _check(len(ids) > 0, f"{name}[{i}]", "must hold at least 1 token id", ids)
    num_tokens = sum(len(ids) for ids in sequences)
    if num_tokens > MAX_BAD_WORDS_TOTAL_TOKENS:
        raise ValueError(
            f"{name} must hold at most {MAX_BAD_WORDS_TOTAL_TOKENS} token ids in all, "
            f"got {num_tokens}"
        )
    return sequences
