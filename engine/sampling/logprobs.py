"""Logprobs under the RAW model distribution (before any processing): of the sampled tokens, and
of given tokens (a prompt's, for ``prompt_logprobs``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling.messages import SamplingRow, TokenLogprobs


def compute_logprobs(
    logits: torch.Tensor, rows: Sequence[SamplingRow], token_ids: torch.Tensor
) -> list[TokenLogprobs | None]:
    """For rows with ``params.logprobs`` set: the sampled token's logprob and rank, plus top-N.

    ``logits`` [B, V] are the unprocessed model logits, ``token_ids`` [B] the sampled tokens.
    The rank is 1 + the number of tokens strictly more likely than the sampled one.
    """
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(rows)
    if not wanted:
        return result
    if len(wanted) < len(rows):
        sel = torch.tensor(wanted, dtype=torch.long, device=logits.device)
        logits, token_ids = logits.index_select(0, sel), token_ids.index_select(0, sel)
    logprobs = logits.float().log_softmax(dim=-1)  # [b, V]
    sampled = logprobs.gather(1, token_ids.unsqueeze(1))  # [b, 1]
    ranks = (logprobs > sampled).sum(dim=-1) + 1  # [b]
    num_top = [rows[i].params.logprobs or 0 for i in wanted]
    max_top = min(max(num_top), logprobs.shape[1])
    top_logprobs, top_ids = logprobs.topk(max_top, dim=-1)  # [b, max_top], descending
    token_list, sampled_list, rank_list = token_ids.tolist(), sampled[:, 0].tolist(), ranks.tolist()
    top_lp_list, top_id_list = top_logprobs.tolist(), top_ids.tolist()
    for j, i in enumerate(wanted):
        n = num_top[j]
        result[i] = TokenLogprobs(
            sampled_token_id=token_list[j],
            sampled_logprob=sampled_list[j],
            sampled_rank=rank_list[j],
            top_token_ids=tuple(top_id_list[j][:n]),
            top_logprobs=tuple(top_lp_list[j][:n]),
        )
    return result


def token_and_top_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of ``logits`` [R, V] (raw): the logprob [R] and vLLM's rank [R] of the row's
    token in ``token_ids`` [R], and the ``num_top`` most likely tokens [R, N] with their
    logprobs [R, N], descending (N = min(num_top, V)).

    vLLM's rank (``batched_count_greater_than``): the number of tokens at least as likely as
    the given one, itself included; a token tied with others ranks below all of them.
    """
    logprobs = logits.float().log_softmax(dim=-1)  # [R, V]
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [R, 1]
    ranks = (logprobs >= chosen).sum(dim=-1)  # [R]
    top_logprobs, top_ids = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)  # [R, N]
    return chosen[:, 0], ranks, top_ids, top_logprobs
