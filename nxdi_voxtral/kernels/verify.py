"""Multi-token greedy verify: NKI kernels and their torch twins (kernels/verify_ref.py).

Contract (kernels/verify_ref.py; both implementations, bit-exact):
  greedy_verify(candidates [B, K+1] int32, logits [B, K+1, V] fp32 | bf16, n_valid [B] int32)
      -> target_tokens [B, K+1] int32 (first index on ties, as torch.argmax), accepted [B] int32, bonus [B] int32
  greedy_accept(candidates [B, K+1] int32, target_tokens [B, K+1] int32, n_valid [B] int32)
      -> (target_tokens, accepted, bonus): the accept half, used after a tensor-parallel argmax combine.
  accepted = number of leading proposals j < n_valid with candidates[:, j+1] == target_tokens[:, j];
  bonus = target_tokens[:, accepted].

Kernel tile plan:
  argmax: kernels/rank_argmax.argmax_rows over the B*(K+1) rows of logits viewed as [B*(K+1), V]
          (rows on partitions, vocabulary segments of <= 16384 side by side), written to the target output.
  accept: per tile of <= 128 batch rows (batch on partitions, the K+1 slots on the free axis), the target
          tokens are read back from HBM in that layout (a DMA round trip is the transpose), then
          mismatch = (cand[:, 1:] != target[:, :-1]) (int32 compare), padded = (j >= n_valid),
          bad = max(mismatch, padded), cumsum(bad) by tensor_tensor_scan, accepted = sum(cumsum == 0)
          (tensor_reduce on the free axis: the cumsum form of verify_ref), bonus = sum(target * (j == accepted)).
"""
from __future__ import annotations

import torch

from .nki_api import KernelArgumentError, nisa, nki, nl
from .rank_argmax import argmax_rows, check_vocab
from .verify_ref import greedy_accept_ref, greedy_verify_ref

PMAX = 128

# the torch twins are the lead's reference functions
greedy_verify_torch = greedy_verify_ref
greedy_accept_torch = greedy_accept_ref


def check_verify_args(candidates: torch.Tensor, logits: torch.Tensor | None, n_valid: torch.Tensor,
                      target: torch.Tensor | None = None):
    """Static checks (shapes and dtypes only: nothing here reads device values)."""
    if candidates.dim() != 2 or candidates.dtype != torch.int32:
        raise KernelArgumentError(f"candidates must be [B, K+1] int32, got {tuple(candidates.shape)} "
                                  f"{candidates.dtype}")
    b, k1 = candidates.shape
    if tuple(n_valid.shape) != (b,) or n_valid.dtype != torch.int32:
        raise KernelArgumentError(f"n_valid must be [{b}] int32, got {tuple(n_valid.shape)} {n_valid.dtype}")
    if logits is not None:
        if logits.dim() != 3 or tuple(logits.shape[:2]) != (b, k1):
            raise KernelArgumentError(f"logits must be [{b}, {k1}, V], got {tuple(logits.shape)}")
        if logits.dtype not in (torch.float32, torch.bfloat16):
            raise KernelArgumentError(f"logits must be float32 or bfloat16, got {logits.dtype}")
        check_vocab(logits.shape[2])
    if target is not None and (tuple(target.shape) != (b, k1) or target.dtype != torch.int32):
        raise KernelArgumentError(f"target_tokens must be [{b}, {k1}] int32, got {tuple(target.shape)} "
                                  f"{target.dtype}")


def accept_rows(candidates, target, n_valid, accepted, bonus):
    """Sub-kernel (no @nki.jit). HBM candidates / target [B, K+1] int32, n_valid [B] int32 ->
    accepted / bonus [B] int32 (HBM outputs)."""
    b_all, k1 = candidates.shape
    k = k1 - 1
    for b0 in range(0, b_all, PMAX):
        bt = min(PMAX, b_all - b0)
        cand = nl.ndarray((bt, k1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=cand, src=candidates[b0:b0 + bt, :])
        tgt = nl.ndarray((bt, k1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tgt, src=target[b0:b0 + bt, :])
        nv = nl.ndarray((bt, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=nv, src=n_valid[b0:b0 + bt])
        slot = nl.ndarray((bt, k1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.iota(dst=slot, pattern=[[1, k1]], offset=0)
        acc = nl.ndarray((bt, 1), dtype=nl.int32, buffer=nl.sbuf)
        if k == 0:
            nisa.memset(dst=acc, value=0)
        else:
            nv_f = nl.ndarray((bt, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=nv_f, src=nv)
            bad = nl.ndarray((bt, k), dtype=nl.int32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=bad, data1=cand[:, 1:k1], data2=tgt[:, 0:k], op=nl.not_equal)
            padded = nl.ndarray((bt, k), dtype=nl.int32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=padded, data=slot[:, 0:k], op0=nl.greater_equal, operand0=nv_f)
            nisa.tensor_tensor(dst=bad, data1=bad, data2=padded, op=nl.maximum)
            ones = nl.ndarray((bt, k), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=ones, value=1.0)
            csum = nl.ndarray((bt, k), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor_scan(dst=csum, data0=ones, data1=bad, initial=0.0, op0=nl.multiply, op1=nl.add)
            clean = nl.ndarray((bt, k), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=clean, data=csum, op0=nl.equal, operand0=0.0)
            nisa.tensor_reduce(dst=acc, op=nl.add, data=clean, axis=1)
        acc_f = nl.ndarray((bt, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=acc_f, src=acc)
        pick = nl.ndarray((bt, k1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=pick, data=slot, op0=nl.equal, operand0=acc_f)
        nisa.tensor_tensor(dst=pick, data1=pick, data2=tgt, op=nl.multiply)
        bon = nl.ndarray((bt, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=bon, op=nl.add, data=pick, axis=1)
        nisa.dma_copy(dst=accepted[b0:b0 + bt], src=acc)
        nisa.dma_copy(dst=bonus[b0:b0 + bt], src=bon)


@nki.jit
def greedy_verify_kernel(candidates, logits, n_valid):
    b, k1 = candidates.shape
    vocab = logits.shape[2]
    target = nl.ndarray((b, k1), dtype=nl.int32, buffer=nl.shared_hbm)
    accepted = nl.ndarray((b,), dtype=nl.int32, buffer=nl.shared_hbm)
    bonus = nl.ndarray((b,), dtype=nl.int32, buffer=nl.shared_hbm)
    argmax_rows(logits.reshape((b * k1, vocab)), b * k1, vocab, target.reshape((b * k1,)), None)
    accept_rows(candidates, target, n_valid, accepted, bonus)
    return target, accepted, bonus


@nki.jit
def greedy_accept_kernel(candidates, target, n_valid):
    b = candidates.shape[0]
    accepted = nl.ndarray((b,), dtype=nl.int32, buffer=nl.shared_hbm)
    bonus = nl.ndarray((b,), dtype=nl.int32, buffer=nl.shared_hbm)
    accept_rows(candidates, target, n_valid, accepted, bonus)
    return accepted, bonus
