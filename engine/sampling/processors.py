"""Turn penalised logits of sampled (non-greedy) rows into the distribution to sample from.

In order, as vLLM v1: temperature, then min_p, then top_k, then top_p, then softmax. Each step
runs only when some row uses it; rows that do not use a step get its neutral value (k = V,
p = 1, min_p = 0), which leaves them exactly as they were. The input is never modified.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.host_to_device import to_device
from engine.sampling.params import SamplingParams

# Top-k alone uses torch.topk (cheaper than a full sort) when the largest k is at most this.
_TOPK_WITHOUT_SORT_MAX_K = 1024


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Probabilities [B, V] after temperature, min_p, top_k and top_p, for ``logits`` [B, V]."""
    device = logits.device
    vocab_size = logits.shape[1]
    temperatures = [p.temperature for p in params]
    if any(t != 1.0 for t in temperatures):
        logits = logits / _column(temperatures, torch.float32, device)
    min_ps = [p.min_p for p in params]
    if any(m > 0.0 for m in min_ps):
        logits = apply_min_p(logits, _column(min_ps, torch.float32, device))
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_ps = [p.top_p for p in params]
    use_k = any(k < vocab_size for k in top_ks)
    use_p = any(p < 1.0 for p in top_ps)
    if use_p:
        k = _column(top_ks, torch.long, device) if use_k else None
        # 1 - p on the host in float64: in float32 1 - 0.6 is 0.39999998, which moved the
        # boundary of a row whose mass reaches exactly p
        drop_mass = _column([1.0 - p for p in top_ps], torch.float32, device)
        logits = apply_top_k_top_p(logits, k, drop_mass)
    elif use_k:
        logits = apply_top_k(logits, top_ks)
    return logits.softmax(dim=-1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose prob is below ``min_p`` [B, 1] times the row's largest prob."""
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p  # [B, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    """Keep each row's ``top_ks[row]`` largest logits (ties with the k-th kept); k = V: all."""
    vocab_size = logits.shape[1]
    enabled = [k for k in top_ks if k < vocab_size]
    max_k = max(enabled, default=vocab_size)
    device = logits.device
    if max_k > _TOPK_WITHOUT_SORT_MAX_K:
        return apply_top_k_top_p(logits, _column(top_ks, torch.long, device), None)
    # Rows without top-k ask for k = 1 here and get a -inf threshold below.
    k = _column([k if k < vocab_size else 1 for k in top_ks], torch.long, device)  # [B, 1]
    kth = logits.topk(max_k, dim=-1).values.gather(1, k - 1)  # [B, 1] k-th largest logit
    disabled = _column([k >= vocab_size for k in top_ks], torch.bool, device)
    kth.masked_fill_(disabled, float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, k: torch.Tensor | None, drop_mass: torch.Tensor | None
) -> torch.Tensor:
    """Top-k (``k`` [B, 1], k = V disables) then top-p (``drop_mass`` [B, 1] = 1 - top_p) with
    one sort.

    Top-k keeps the k largest logits and any tied with the k-th (as Hugging Face and vLLM).
    Top-p keeps the smallest set of most likely tokens whose mass reaches top_p (always >= 1
    token): in ascending order, a token is dropped while the mass up to and including it is
    <= 1 - top_p. Tokens tied at that boundary are split by their place in a stable sort, as
    Hugging Face and vLLM split them: keeping them all made the set larger than top_p asks.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=False, stable=True)  # [B, V]
    if k is not None:
        kth = sorted_logits.gather(1, logits.shape[1] - k)  # [B, 1] k-th largest logit
        if drop_mass is None:
            return logits.masked_fill(logits < kth, float("-inf"))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if drop_mass is None:
        return logits
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    dropped = cumulative <= drop_mass
    dropped[:, -1] = False  # the most likely token always survives
    sorted_logits.masked_fill_(dropped, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _column(
    values: Sequence[float | int | bool], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    return to_device(values, dtype, device).unsqueeze(1)  # [B, 1]
