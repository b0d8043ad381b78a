"""vLLM's ``use_beam_search`` on both OpenAI endpoints: ``n`` beams, best first, found as
transformers' ``generate(num_beams=n)`` finds them (engine/beam_search.py), with vLLM's
``length_penalty`` and transformers' ``early_stopping``.

A beam search has no sampling: a field that would change a sampled output (a temperature other
than 0, top_p, penalties, stop strings, structured outputs ...) is refused naming the field,
never silently ignored; so are a stream and echo, which this server does not give a search.
``max_tokens``, ``ignore_eos``, ``logprobs`` and ``return_token_ids`` keep their meaning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.beam_search import BeamSearchParams
from engine.sampling.params import SamplingParams
from router.gateway.errors import invalid
from router.gateway.spec import GenerationSpec

# SamplingParams fields a search cannot honour -> the request field that sets it
_SAMPLING_FIELDS = {
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "logit_bias": "logit_bias",
    "allowed_token_ids": "allowed_token_ids",
    "bad_words_token_ids": "bad_words",
    "stop_token_ids": "stop_token_ids",
    "min_tokens": "min_tokens",
    "prompt_logprobs": "prompt_logprobs",
}
# the request fields that may set an output constraint (the spec's structured_outputs)
_CONSTRAINT_FIELDS = (
    "tool_choice",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
)


@dataclass(frozen=True, slots=True)
class BeamOptions:
    """What a request asks of its search beside ``n`` and each prompt's ``max_tokens``, as
    sent: ``BeamSearchParams`` checks them (``check_beam_search``)."""

    length_penalty: Any = 1.0
    early_stopping: Any = False

    def params(self, spec: GenerationSpec, width: int) -> BeamSearchParams:
        """The search of one prompt's spec (its max_tokens already fitted to the context)."""
        max_tokens = spec.params.max_tokens
        assert max_tokens is not None  # (make_spec resolves it)
        return BeamSearchParams(
            beam_width=width,
            max_tokens=max_tokens,
            ignore_eos=spec.params.ignore_eos,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            include_stop_str_in_output=spec.include_stop_str_in_output,
        )


def checked_beam_options(body: dict[str, Any]) -> BeamOptions | None:
    """The request's beam search (None: it samples); refuses, naming the field, what a search
    cannot give: a stream, echo, a temperature other than 0."""
    use = body.get("use_beam_search")
    if use is None or use is False:
        penalty, early_stopping = body.get("length_penalty"), body.get("early_stopping")
        if penalty is not None and (isinstance(penalty, bool) or penalty != 1):
            raise invalid("length_penalty applies only with use_beam_search true", "length_penalty")
        if early_stopping is not None and early_stopping is not False:
            raise invalid("early_stopping applies only with use_beam_search true", "early_stopping")
        return None
    if use is not True:
        raise invalid("use_beam_search must be a boolean", param="use_beam_search")
    for name in ("stream", "echo"):
        if body.get(name) is True:
            raise invalid(f"{name} is not supported with use_beam_search", param=name)
    temperature = body.get("temperature")
    if temperature is not None and temperature != 0:
        raise invalid(
            f"temperature must be 0 or unset with use_beam_search (got {temperature}): beams "
            "are ranked by the model's own log-probabilities",
            param="temperature",
        )
    return BeamOptions(body.get("length_penalty", 1.0), body.get("early_stopping", False))


def check_beam_search(
    body: dict[str, Any], specs: list[GenerationSpec], options: BeamOptions, num_eos: int
) -> None:
    """Each prompt's spec can be searched with its ``n`` beams: no sampling option set, and
    the search's parameters valid (``n`` is bounded: a step reads max(2, 1 + ``num_eos``) x n
    log-probabilities of each beam); ApiError(400) naming the field."""
    for spec in specs:
        _check_searchable(body, spec)
        try:
            options.params(spec, spec.params.n).candidates_per_beam(num_eos)
        except ValueError as error:
            field = str(error).split(" ", 1)[0]  # BeamSearchParams' errors start with it
            name = "n" if field == "beam_width" else field
            raise invalid(str(error).replace(field, name, 1), param=name) from error


def _check_searchable(body: dict[str, Any], spec: GenerationSpec) -> None:
    """Refuses, naming the field, a sampling option set on a beam search's spec."""
    params, off = spec.params, SamplingParams()
    for field, name in _SAMPLING_FIELDS.items():
        value = getattr(params, field)
        if value != getattr(off, field) and not (field == "top_k" and value == -1):
            raise _refused(name)
    if spec.stop:
        raise _refused("stop")
    if params.structured_outputs is not None:
        raise _refused(next((n for n in _CONSTRAINT_FIELDS if n in body), "structured_outputs"))


def _refused(name: str) -> Exception:
    return invalid(f"{name} is not supported with use_beam_search", param=name)
