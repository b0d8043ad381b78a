"""Beam search: the ``beam_width`` most likely continuations of a prompt, as transformers'
``generate(num_beams=..., do_sample=False)`` finds them (its rules, step for step), driven
through any engine that returns a position's top log-probabilities.

The search asks for one token of each running beam at a time (``pending``: the prompt and the
beam's tokens so far), reading that position's top ``candidates_per_beam`` log-probabilities of
the model's own distribution (``advance``). Each step, as transformers does:
- the ``K = max(2, 1 + #eos) * beam_width`` best continuations of all beams together, by the sum
  of their log-probabilities, are the candidates (each is in its own beam's top K, which is why
  K log-probabilities per beam suffice);
- a candidate among the first ``beam_width`` that ends in eos (or reaches ``max_tokens``) is a
  finished hypothesis, scored by its sum over ``generated_len ** length_penalty`` (eos counted);
  the best ``beam_width`` hypotheses are kept;
- the ``beam_width`` best candidates that did not finish run on;
- the search ends at ``max_tokens``, or once ``beam_width`` hypotheses are kept and no running
  beam can beat the worst of them (``early_stopping``: False, transformers' default heuristic,
  the running beam's score at its current length; "never": at ``max_tokens`` when the length
  penalty rewards length; True: as soon as ``beam_width`` hypotheses are kept).

The engine's prefix cache makes a step cost about one token per beam: every request is the
previous one's prompt plus a token. Pure Python; ``LLM.beam_search`` and the gateway drive it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from engine.outputs import Logprob, PositionLogprobs
from engine.sampling.params import MAX_LOGPROBS

EarlyStopping = bool | Literal["never"]


@dataclass(frozen=True, slots=True, kw_only=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``: how wide and how long; validated at construction."""

    beam_width: int  # beams kept, and sequences returned
    max_tokens: int  # most tokens generated per sequence
    ignore_eos: bool = False  # eos is a token like any other (no hypothesis finishes early)
    temperature: float = 0.0  # must be 0: the model's own log-probabilities rank the beams
    length_penalty: float = 1.0  # a finished sum is divided by its length ** this
    early_stopping: EarlyStopping = False  # transformers' rule (see the module)
    include_stop_str_in_output: bool = False  # the eos token's text in ``text``

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, 1)
        _check_int("max_tokens", self.max_tokens, 1)
        if self.temperature != 0:
            raise ValueError(
                f"temperature must be 0 for beam search (got {self.temperature}): beams are "
                "ranked by the model's own log-probabilities, as transformers' with do_sample "
                "false"
            )
        if isinstance(self.length_penalty, bool) or not isinstance(
            self.length_penalty, int | float
        ):
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f"early_stopping must be true, false or 'never', got {self.early_stopping!r}"
            )

    def candidates_per_beam(self, num_eos: int) -> int:
        """K: the top log-probabilities each beam's position is read for; ValueError naming
        beam_width when K exceeds what one request may ask for (MAX_LOGPROBS)."""
        per_width = max(2, 1 + num_eos)
        if self.beam_width * per_width > MAX_LOGPROBS:
            raise ValueError(
                f"beam_width must be at most {MAX_LOGPROBS // per_width} for this model (got "
                f"{self.beam_width}): each step reads the top {per_width} x beam_width "
                f"log-probabilities of every beam, at most {MAX_LOGPROBS}"
            )
        return self.beam_width * per_width


@dataclass(slots=True)
class BeamSearchSequence:
    """One returned beam, as vLLM's: ``tokens`` are the prompt's and the generated ones."""

    tokens: list[int]
    num_prompt_tokens: int
    logprobs: list[PositionLogprobs]  # per generated position: its token and the step's top K
    cum_logprob: float  # the sum of the generated tokens' log-probabilities
    score: float  # what ranked it: cum_logprob / len(generated) ** length_penalty
    finish_reason: Literal["stop", "length"]  # "stop": it ended in eos
    text: str = ""  # the prompt's and the generated tokens' text, when a tokenizer is loaded

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]

    def shown_token_ids(self, include_stop_str_in_output: bool) -> list[int]:
        """The output tokens its text shows: less the eos that ended it, unless asked."""
        output = self.output_token_ids
        return (
            output[:-1]
            if self.finish_reason == "stop" and not include_stop_str_in_output
            else output
        )


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclass(frozen=True, slots=True)
class _Beam:
    tokens: tuple[int, ...]  # generated so far
    logprobs: tuple[Mapping[int, Logprob], ...]  # each position's top K (shared, never changed)
    sum_logprob: float


@dataclass(slots=True)
class BeamSearch:
    """One prompt's search; ``pending()`` -> the engine's top log-probabilities for each ->
    ``advance`` -> ... until ``done``; then ``best()``."""

    prompt_token_ids: list[int]
    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    candidates_per_beam: int = field(init=False)  # K
    _ends: frozenset[int] = field(init=False)  # the tokens that end a hypothesis
    _running: list[_Beam] = field(init=False)
    _finished: list[tuple[float, _Beam]] = field(init=False, default_factory=list)
    _generated: int = field(init=False, default=0)
    done: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._running = [_Beam((), (), 0.0)]  # transformers' first step: one live beam
        self._ends = frozenset() if self.params.ignore_eos else self.eos_token_ids
        self.candidates_per_beam = self.params.candidates_per_beam(len(self._ends))

    def pending(self) -> list[list[int]]:
        """The token ids (prompt, then the beam's) whose next position each running beam
        needs; empty once done."""
        if self.done:
            return []
        return [self.prompt_token_ids + list(beam.tokens) for beam in self._running]

    def advance(self, top_logprobs: Sequence[Mapping[int, Logprob]]) -> None:
        """One step: ``top_logprobs[i]`` holds (at least) the top ``candidates_per_beam``
        log-probabilities of the position after ``pending()[i]``."""
        if len(top_logprobs) != len(self._running):
            raise ValueError(f"{len(top_logprobs)} positions for {len(self._running)} beams")
        width = self.params.beam_width
        candidates = sorted(
            (
                (beam.sum_logprob + logprob.logprob, index, token_id, position)
                for index, (beam, position) in enumerate(zip(self._running, top_logprobs))
                for token_id, logprob in position.items()
            ),
            key=lambda candidate: -candidate[0],
        )[: self.candidates_per_beam]
        self._generated += 1
        at_limit = self._generated >= self.params.max_tokens
        running: list[_Beam] = []
        for rank, (total, index, token_id, position) in enumerate(candidates):
            finishes = at_limit or token_id in self._ends
            # only the top beam_width may finish (transformers' rule); beam_width run on
            if (rank >= width) if finishes else (len(running) >= width):
                continue
            parent = self._running[index]
            beam = _Beam(parent.tokens + (token_id,), parent.logprobs + (position,), total)
            if finishes:
                self._finished.append((total / self._generated**self.params.length_penalty, beam))
            else:
                running.append(beam)
        self._finished.sort(key=lambda hypothesis: -hypothesis[0])
        del self._finished[width:]
        self._running = running
        self.done = at_limit or not running or self._cannot_improve()

    def _cannot_improve(self) -> bool:
        """Every slot holds a hypothesis and (as transformers judges it) the best running beam
        cannot beat the worst of them."""
        if len(self._finished) < self.params.beam_width:
            return False
        if self.params.early_stopping is True:
            return True
        penalty = self.params.length_penalty
        length = self._generated
        if self.params.early_stopping == "never" and penalty > 0:
            length = self.params.max_tokens
        best_running = self._running[0].sum_logprob / length**penalty
        return best_running <= self._finished[-1][0]

    def best(self) -> list[BeamSearchSequence]:
        """The kept hypotheses, best first (done searches only)."""
        if not self.done:
            raise RuntimeError("the search has not finished")
        return [
            BeamSearchSequence(
                tokens=self.prompt_token_ids + list(beam.tokens),
                num_prompt_tokens=len(self.prompt_token_ids),
                logprobs=[dict(position) for position in beam.logprobs],
                cum_logprob=beam.sum_logprob,
                score=score,
                finish_reason="stop" if beam.tokens[-1] in self._ends else "length",
            )
            for score, beam in self._finished
        ]


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
