"""The batched sampler the model runner calls once per step: logits [B, V] -> one token per row.

Processing order (as vLLM v1, ``vllm/v1/sample/sampler.py``):

1. Logprobs, for rows with ``params.logprobs`` set, come from the RAW distribution:
   ``log_softmax`` of the unprocessed logits (``logprobs.py``), before the allowed-token mask,
   bad words, the logit bias, bans and penalties. That is vLLM's default,
   ``logprobs_mode="raw_logprobs"`` (``ModelConfig`` in ``vllm/config/model.py``: "Raw means the
   values before applying any logit processors, like bad words"); its sampler computes them
   before ``apply_logits_processors``. So a token's logprob does not move with its bias, and a
   token outside ``allowed_token_ids`` keeps its raw logprob in the top-N.
2. ``allowed_token_ids``: every other token -> -inf; then bad words: the token that would
   complete one of ``bad_words_token_ids`` after the output so far -> -inf (``bad_words.py``);
   then ``logit_bias`` added (``logit_bias.py``). vLLM's order: the allowed-token mask, bad words,
   then the logits processors that include the bias.
3. Banned token ids -> -inf (the engine bans eos + stop ids while under ``min_tokens``).
4. Repetition penalty over prompt + output tokens (HF rule: divide positive logits, multiply
   negative ones), then presence / frequency penalties over output tokens (``penalties.py``).
5. Greedy rows (``params.greedy``) take the argmax of the penalised logits. Sampled rows go on:
6. temperature, min_p, top_k, top_p, softmax (``processors.py``);
7. an exact draw from that distribution by the exponential race (``rng.py``). A seeded row
   consumes one [V] draw from its own generator per step, so its tokens do not depend on the
   rest of the batch; unseeded rows share one batched draw from the global RNG.

Fast paths: an all-greedy batch without allowed tokens, bad words, bias, bans or penalties is one
argmax; mask, bad words, bias, penalty, min_p and top-k/top-p work is skipped (no tensor built)
when no row asks for it. The input logits are never modified.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.host_to_device import to_device
from engine.sampling.logit_bias import apply_allowed_and_bias
from engine.sampling.logprobs import compute_logprobs
from engine.sampling.messages import SamplerOutput, SamplingRow
from engine.sampling.penalties import apply_penalties
from engine.sampling.processors import sampling_probs
from engine.sampling.rng import sample_from_probs


class Sampler:
    """Stateless; per-request state (generators, token history) arrives in the rows."""

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        return self.outputs(logits, rows, self.draw(logits, rows))

    def draw(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Token ids [B] on the logits' device, without waiting for them (async scheduling
        feeds them to the next step before they reach the host)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [num_rows={len(rows)}, vocab_size], got {tuple(logits.shape)}"
            )
        logits = logits.float()  # [B, V]; a no-op for float32
        penalised = self.processed_logits(logits, rows)
        sampled_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not sampled_rows:
            return penalised.argmax(dim=-1)  # [B]
        return self._sample(penalised, rows, sampled_rows)

    @staticmethod
    def outputs(
        logits: torch.Tensor, rows: Sequence[SamplingRow], token_ids: torch.Tensor
    ) -> SamplerOutput:
        """The host-side output of ``draw``'s ``token_ids`` [B]: the ids, and the logprobs the
        rows ask for, from the raw ``logits`` [B, V]."""
        return SamplerOutput(
            sampled_token_ids=token_ids.tolist(),
            logprobs=compute_logprobs(logits, rows, token_ids),
        )

    @staticmethod
    def processed_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Steps 2-4 above: float ``logits`` [B, V] after the allowed-token mask, bad words,
        bias, bans and penalties; ``logits`` itself when no row asks for any of them."""
        constrained = apply_allowed_and_bias(logits, rows)  # [B, V]; logits itself when unused
        # a copy made above is ours to modify in place
        return apply_penalties(constrained, rows, inplace=constrained is not logits)

    def _sample(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], sampled_rows: list[int]
    ) -> torch.Tensor:
        """Token ids [B]: drawn for ``sampled_rows``, argmax for the (greedy) others."""
        if len(sampled_rows) == len(rows):
            probs = sampling_probs(logits, [row.params for row in rows])
            return sample_from_probs(probs, [row.generator for row in rows])
        sel = to_device(sampled_rows, torch.long, logits.device)
        subset = [rows[i] for i in sampled_rows]
        probs = sampling_probs(logits.index_select(0, sel), [row.params for row in subset])
        drawn = sample_from_probs(probs, [row.generator for row in subset])  # [b]
        return logits.argmax(dim=-1).index_copy_(0, sel, drawn)
