"""Next-token sampling and log-probs, one row per request, with SGLang's maths (its torch sampler).

* Returned log-probs are ``log_softmax(logits / T)`` over the full vocabulary: temperature-scaled,
  **not** renormalised after top-k / top-p / min-p truncation. Greedy rows (T <= 1e-6) get the
  unscaled ``log_softmax(logits)``. Prompt log-probs are always the plain ``log_softmax``.
* Truncation, as SGLang's torch sampler applies it on probabilities sorted in descending order:
  a token survives top-p when the mass *before* it is <= top_p (so the first always survives),
  top-k keeps ranks < k, min-p keeps p >= min_p · p_max.
* Randomness: one uniform draw per sampled row, inverted through the row's CDF. A request with
  ``sampling_seed`` draws from its own ``torch.Generator``, and a row's token depends only on its
  own logits, parameters and draw, so a seeded request samples the same tokens whatever else is in
  the batch. Greedy rows draw nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

GREEDY_EPS = 1e-6


@dataclass(frozen=True)
class RowSampling:
    """One row's sampling parameters (already validated by ``SamplingParams``)."""

    temperature: float = 1.0
    top_k: int = -1  # -1 = whole vocabulary
    top_p: float = 1.0
    min_p: float = 0.0
    generator: torch.Generator | None = None  # None = the engine's shared generator
    top_logprobs_num: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_EPS

    @property
    def truncates_by_rank(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


@dataclass
class SampleOutput:
    token_ids: list[int]  # (B,)
    logprobs: list[float]  # (B,) logprob of token_ids[b] under row b's returned distribution
    top: list[list[tuple[float, int]] | None]  # per row: top_logprobs_num (logprob, id) pairs, or None


def sample_next_tokens(logits: Tensor, rows: list[RowSampling], shared_generator: torch.Generator | None = None,
                       banned: Tensor | None = None) -> SampleOutput:
    """Pick one token per row of ``logits`` (B, V).

    ``banned`` (B, V) bool, optional: tokens to exclude before anything else (``min_new_tokens``
    blocks stop tokens this way; as in SGLang the returned log-probs see the exclusion)."""
    logits = logits.float()
    if banned is not None:
        logits = logits.masked_fill(banned, float("-inf"))
    greedy = [r.greedy for r in rows]
    sampled = [b for b, g in enumerate(greedy) if not g]
    if sampled:
        temps = torch.tensor([1.0 if g else r.temperature for g, r in zip(greedy, rows)], dtype=torch.float32,
                             device=logits.device)
        logits_t = logits / temps[:, None]
    else:  # all greedy: T = 1 everywhere, nothing to divide
        logits_t = logits
    logprobs = torch.log_softmax(logits_t, dim=-1)  # log_softmax(logits / T)   (B, V)
    chosen = logits.argmax(dim=-1)  # greedy rows keep this   (B,)
    if sampled:
        chosen[sampled] = _sample_rows(logprobs[sampled], [rows[b] for b in sampled], shared_generator)
    token_lp = logprobs.gather(1, chosen[:, None])[:, 0]
    # one copy to the host for both (float64 holds every token id exactly)
    ids, lps = torch.stack([chosen.double(), token_lp.double()]).tolist()
    return SampleOutput([int(t) for t in ids], lps, top_logprobs(logprobs, [r.top_logprobs_num for r in rows]))


def top_logprobs(logprobs: Tensor, nums: list[int]) -> list[list[tuple[float, int]] | None]:
    """Per row b, the ``nums[b]`` most likely (logprob, token id) pairs, best first (None when 0)."""
    k = min(max(nums, default=0), logprobs.shape[-1])
    if k == 0:
        return [None] * len(nums)
    vals, ids = logprobs.topk(k, dim=-1)
    vals, ids = vals.tolist(), ids.tolist()
    return [list(zip(vals[b][:n], ids[b][:n])) if n > 0 else None for b, n in enumerate(nums)]


def compute_prompt_logprobs(logits: Tensor, targets: list[int], top_num: int = 0
                            ) -> tuple[list[float], list[list[tuple[float, int]]] | None]:
    """Plain ``log_softmax`` (no temperature) at each position: ``logits[j]`` (n, V) scores
    ``targets[j]``. Returns the n logprobs and, when ``top_num`` > 0, the top lists."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(targets, dtype=torch.long, device=lp.device)
    values = lp.gather(1, target[:, None])[:, 0].tolist()
    tops = top_logprobs(lp, [top_num] * len(targets)) if top_num > 0 else None
    return values, tops


def token_ids_logprobs(logits: Tensor, token_ids: list[int]) -> list[list[tuple[float, int]]]:
    """SGLang's ``token_ids_logprob`` at each of n positions: the plain ``log_softmax`` (no
    temperature) of every id in ``token_ids``, as (logprob, id) pairs in the order asked."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    values = lp[:, torch.tensor(token_ids, dtype=torch.long, device=lp.device)].tolist()  # (n, len(token_ids))
    return [list(zip(row, token_ids)) for row in values]


def _sample_rows(logprobs: Tensor, rows: list[RowSampling], shared: torch.Generator | None) -> Tensor:
    """Inverse-CDF sampling of one token per row from the truncated, renormalised distribution."""
    probs = logprobs.exp()  # softmax(logits / T)   (n, V)
    draws = torch.cat([torch.rand(1, generator=r.generator if r.generator is not None else shared)
                       for r in rows]).to(probs.device)
    out = torch.empty(len(rows), dtype=torch.long, device=probs.device)
    # Rows truncated by rank (top-k/top-p) are sampled in descending-probability order, the others
    # in vocabulary order; each row's choice depends only on that row, never on its batch mates.
    by_rank = [i for i, r in enumerate(rows) if r.truncates_by_rank]
    plain = [i for i, r in enumerate(rows) if not r.truncates_by_rank]
    if plain:
        p = probs[plain]
        min_p = torch.tensor([rows[i].min_p for i in plain], dtype=p.dtype, device=p.device)
        if bool((min_p > 0).any()):
            p = p.masked_fill(p < min_p[:, None] * p.max(dim=-1, keepdim=True).values, 0.0)
        out[plain] = _invert_cdf(p, draws[plain])
    if by_rank:
        p, order = probs[by_rank].sort(dim=-1, descending=True)
        sub = [rows[i] for i in by_rank]
        vocab = p.shape[-1]
        top_k = torch.tensor([r.top_k if r.top_k > 0 else vocab for r in sub], device=p.device)
        top_p = torch.tensor([r.top_p for r in sub], dtype=p.dtype, device=p.device)
        min_p = torch.tensor([r.min_p for r in sub], dtype=p.dtype, device=p.device)
        mass_before = p.cumsum(dim=-1) - p
        drop = mass_before > top_p[:, None]  # top-p: the mass before the token already reaches top_p
        drop |= torch.arange(vocab, device=p.device)[None, :] >= top_k[:, None]  # top-k: rank >= k
        drop |= p < min_p[:, None] * p[:, :1]  # min-p against the most likely token
        p = p.masked_fill(drop, 0.0)
        out[by_rank] = order.gather(1, _invert_cdf(p, draws[by_rank])[:, None])[:, 0]
    return out


def _invert_cdf(p: Tensor, u: Tensor) -> Tensor:
    """Index i with cdf[i-1] <= u·total < cdf[i]: a zero-probability entry is never chosen."""
    cdf = p.cumsum(dim=-1)
    target = (u * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=p.shape[-1] - 1)
    # u·total can round up to total itself; then fall back to the most likely entry
    hit_zero = p.gather(1, idx[:, None])[:, 0] <= 0
    return torch.where(hit_zero, p.argmax(dim=-1), idx)
