"""Torch reference of the multi-token greedy verify kernel (the contract the NKI kernel will implement).

greedy_verify_ref(candidates, logits, n_valid) -> (target_tokens, accepted, bonus)
  candidates [B, K+1] int32: the last accepted token followed by K proposed tokens
  logits     [B, K+1, V]:    target logits after each candidate
  n_valid    [B] int32:      how many of the K proposals are real (shorter proposals are padded)
  target_tokens [B, K+1] int32: per-position argmax, first index on ties (as torch.argmax)
  accepted      [B] int32:      length of the prefix of proposals equal to the target's previous-slot argmax
  bonus         [B] int32:      target_tokens at slot `accepted` (the token the target adds after the prefix)
No sort / nonzero / boolean indexing: the accepted length is the number of slots before the first mismatch,
counted as `(cumsum(mismatch) == 0).sum()` (int32 cumprod has no XLA lowering: it falls back to the CPU and
ModelBuilder bakes the fallback's value into the HLO), then a gather.
"""
import torch


def greedy_verify_ref(candidates: torch.Tensor, logits: torch.Tensor, n_valid: torch.Tensor):
    return greedy_accept_ref(candidates, torch.argmax(logits, dim=-1).to(torch.int32), n_valid)


def greedy_accept_ref(candidates: torch.Tensor, target: torch.Tensor, n_valid: torch.Tensor):
    """The accept half, given the target's argmax tokens [B, K+1] (with TP, the argmax is combined across ranks
    first: tp.vocab_greedy)."""
    k = candidates.shape[1] - 1
    real = torch.arange(k, dtype=torch.int32, device=candidates.device)[None, :] < n_valid[:, None]
    mismatch = ((candidates[:, 1:] != target[:, :-1]) | ~real).to(torch.int32)
    accepted = (torch.cumsum(mismatch, dim=1) == 0).sum(dim=1).to(torch.int32)
    bonus = torch.gather(target, 1, accepted[:, None].long())[:, 0]
    return target, accepted, bonus
