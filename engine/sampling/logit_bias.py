"""The request's own edits of the logits, applied first: ``allowed_token_ids``, bad words, then
``logit_bias``.

``allowed_token_ids`` (vLLM's): every token of the row not in the list gets -inf.
``bad_words_token_ids`` (vLLM's ``bad_words``, ``bad_words.py``): the token that would complete a
bad word gets -inf.
``logit_bias`` (OpenAI's): each named token's logit gets its bias added (a bias of -100 all but
bans a token, +100 all but forces it). Both change the argmax, so greedy rows see them too.

They run before the bans and penalties of ``penalties.py``, as vLLM v1's sampler orders them
(``vllm/v1/sample/sampler.py``, ``Sampler.apply_logits_processors``: the allowed-token mask, bad
words, then the non-argmax-invariant logits processors - min_tokens, then logit bias
(``LogitBiasLogitsProcessor`` in ``vllm/v1/sample/logits_processor/builtin.py``) - then the
penalties). Our min_tokens bans come after the bias rather than before it; both orders give the
same logits, since a banned or disallowed logit is -inf and -inf plus a finite bias stays -inf.

Rows that use none of the fields are not touched, and when no row uses them the logits are returned
as they are: no tensor is built and nothing is copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.host_to_device import to_device
from engine.sampling.bad_words import ban_bad_words
from engine.sampling.messages import SamplingRow
from engine.sampling.penalties import flat_index


def apply_allowed_and_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Return ``logits`` [B, V] with each row's allowed-token mask, bad words and logit bias
    applied, in that order (vLLM v1's).

    The input is never modified: a copy is made when some row uses any of the fields. Work is
    sparse, over the (row, token) pairs the rows name, plus one -inf fill per restricted row.
    """
    restricted = [i for i, row in enumerate(rows) if row.params.allowed_token_ids is not None]
    barred = [i for i, row in enumerate(rows) if row.params.bad_words_token_ids]
    biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
    if not (restricted or barred or biased):
        return logits
    logits = logits.clone()
    if restricted:
        _keep_allowed(logits, rows, restricted)
    if barred:
        ban_bad_words(logits, rows, barred)
    if biased:
        _add_bias(logits, rows, biased)
    return logits


def _keep_allowed(logits: torch.Tensor, rows: Sequence[SamplingRow], use: list[int]) -> None:
    allowed = [rows[i].params.allowed_token_ids or () for i in use]
    row_idx, token_idx = flat_index(use, allowed, logits)  # [n] pairs, unique per row
    kept = logits[row_idx, token_idx]  # [n]
    logits.index_fill_(0, to_device(use, torch.long, logits.device), float("-inf"))
    logits[row_idx, token_idx] = kept


def _add_bias(logits: torch.Tensor, rows: Sequence[SamplingRow], use: list[int]) -> None:
    biases = [rows[i].params.logit_bias or {} for i in use]
    row_idx, token_idx = flat_index(use, [list(b) for b in biases], logits)  # [n], unique pairs
    values = [bias for b in biases for bias in b.values()]  # same order as the keys above
    bias = to_device(values, logits.dtype, logits.device)  # [n]
    logits[row_idx, token_idx] += bias
