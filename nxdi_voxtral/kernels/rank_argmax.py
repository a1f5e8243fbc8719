"""Rank-local argmax: (max value, first local index) per row of vocab-sharded logits; NKI kernel and torch twin.

Contract (both implementations):
  rank_argmax(logits [..., V_local] fp32 | bf16) -> (max_values [...] same dtype as logits,
                                                     first_index [...] int32)
  first_index is the lowest index holding the row maximum, exactly `torch.argmax(logits, -1)`.
  combine_rank_argmax(values [tp, ...], indices [tp, ...] int32, shard_size) -> global index [...] int32:
  the cross-rank step (after an all-gather, in rank order) that stays in torch: the largest value wins, the
  lowest rank among equal values (= the lowest global id, shards being ascending vocab ranges);
  global = rank * shard_size + local. Equals torch.argmax over the full vocabulary.

The NKI kernel's tile plan (`argmax_rows`, shared with kernels/verify.py):
  rows R = prod(leading dims) go in row tiles of rt = min(128, R) partitions. Each row is cut into S segments
  of L <= 16384 elements (the max8 / nc_find_index8 limit); F = 128 // rt segments of every row sit side by side
  on the partitions (partition p = f * rt + r), so one pass handles rt * F <= 128 (row, segment) pairs:
    pass:    1 DMA load [F*rt, L] (+ memset -inf and 1 DMA for a short last segment), max8, nc_find_index8,
             2 DMA writes of column 0 (value fp32, local index uint32) into [rt, S] HBM scratch
             (the DMA does the transpose: segments land on the free axis);
    combine: 2 DMA loads [rt, S], iota (segment starts s*L, int32), tensor_tensor add (global index, integer
             math), tensor_reduce max (row max), tensor_scalar ((v != max) * S*L, the penalty), tensor_tensor
             add, tensor_reduce min -> the lowest global index holding the max (ties inside a segment: the
             first occurrence from nc_find_index8; across segments: the minimum), 1-2 DMA writes.
  Indices are int32/uint32 tiles throughout; the only float step is tensor_reduce's fp32 arithmetic on
  integers < 2 * S * L < 2^24 (checked: V_local <= 2^22), which is exact. Values stay fp32 (bf16 -> fp32 exact).
"""
from __future__ import annotations

import torch

from .nki_api import KernelArgumentError, nisa, nki, nl

PMAX = 128
SEG_MAX = 16384      # max8 / nc_find_index8: at most 16384 elements per partition
V_MAX = 1 << 22      # keeps every index sum < 2^24 (exact in fp32 reductions)


# ------------------------------------------------------------------------------------------------ twin
def rank_argmax_torch(logits: torch.Tensor):
    idx = torch.argmax(logits, dim=-1, keepdim=True)
    return torch.gather(logits, -1, idx)[..., 0], idx[..., 0].to(torch.int32)


def combine_rank_argmax(values: torch.Tensor, indices: torch.Tensor, shard_size: int) -> torch.Tensor:
    """values / indices: [tp, ...] in rank order (an all-gather of every rank's rank_argmax)."""
    tp = values.shape[0]
    winner = torch.argmax(values, dim=0, keepdim=True)  # first (lowest) rank among equal maxima
    offset = (torch.arange(tp, dtype=torch.int32, device=indices.device) * shard_size).view(
        [tp] + [1] * (indices.dim() - 1))
    return torch.gather(indices.to(torch.int32) + offset, 0, winner)[0].to(torch.int32)


# --------------------------------------------------------------------------------------------- kernel
def plan(rows: int, vocab: int):
    """(row tile, segments per pass, segment length, segments per row): the tile plan of argmax_rows."""
    rt = min(PMAX, rows)
    f = max(1, PMAX // rt)
    seg = min(SEG_MAX, max(8, -(-vocab // f)))
    return rt, f, seg, -(-vocab // seg)


def describe_plan(rows: int, vocab: int) -> dict:
    rt, f, seg, s = plan(rows, vocab)
    return {"row_tile": rt, "segments_per_pass": f, "segment": seg, "segments": s, "passes": -(-s // f),
            "row_tiles": -(-rows // rt), "short_last_segment": vocab % seg != 0}


def check_vocab(vocab: int):
    if not 1 <= vocab <= V_MAX:
        raise KernelArgumentError(f"argmax kernels take 1..{V_MAX} vocabulary entries per rank, got {vocab}")


def argmax_rows(x, rows, vocab, idx_out, val_out):
    """Sub-kernel (no @nki.jit). x: HBM [rows, vocab]; idx_out: HBM [rows] int32; val_out: HBM [rows] or None."""
    rt0, f, seg, s = plan(rows, vocab)
    for r0 in range(0, rows, rt0):
        rt = min(rt0, rows - r0)
        seg_val = nl.ndarray((rt, s), dtype=nl.float32, buffer=nl.hbm)
        seg_idx = nl.ndarray((rt, s), dtype=nl.uint32, buffer=nl.hbm)
        for s0 in range(0, s, f):
            nf = min(f, s - s0)                          # segments in this pass
            nfull = min(nf, max(0, vocab // seg - s0))   # of which entirely inside the vocabulary
            tile = nl.ndarray((nf * rt, seg), dtype=x.dtype, buffer=nl.sbuf)
            if nfull < nf:
                nisa.memset(dst=tile, value=float("-inf"))
            if nfull > 0:
                nisa.dma_copy(dst=tile[0:nfull * rt, :],
                              src=x.ap(pattern=[[seg, nfull], [vocab, rt], [1, seg]], offset=r0 * vocab + s0 * seg))
            if nfull < nf:
                short = vocab - (s0 + nfull) * seg
                nisa.dma_copy(dst=tile[nfull * rt:(nfull + 1) * rt, 0:short],
                              src=x.ap(pattern=[[vocab, rt], [1, short]], offset=r0 * vocab + (s0 + nfull) * seg))
            top = nl.ndarray((nf * rt, 8), dtype=nl.float32, buffer=nl.sbuf)
            nisa.max8(dst=top, src=tile)
            where = nl.ndarray((nf * rt, 8), dtype=nl.uint32, buffer=nl.sbuf)
            nisa.nc_find_index8(dst=where, data=tile, vals=top)  # column 0: first occurrence of the max
            # partition f*rt + r -> scratch[r, s0 + f]: the DMA's access pattern is the transpose
            nisa.dma_copy(dst=seg_val.ap(pattern=[[1, nf], [s, rt], [1, 1]], offset=s0), src=top[:, 0:1])
            nisa.dma_copy(dst=seg_idx.ap(pattern=[[1, nf], [s, rt], [1, 1]], offset=s0), src=where[:, 0:1])
        vals = nl.ndarray((rt, s), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=vals, src=seg_val)
        local = nl.ndarray((rt, s), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.dma_copy(dst=local, src=seg_idx)
        start = nl.ndarray((rt, s), dtype=nl.int32, buffer=nl.sbuf)
        nisa.iota(dst=start, pattern=[[seg, s]], offset=0)
        glob = nl.ndarray((rt, s), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=glob, data1=local, data2=start, op=nl.add)
        vmax = nl.ndarray((rt, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=vmax, op=nl.maximum, data=vals, axis=1)
        penalty = nl.ndarray((rt, s), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=penalty, data=vals, op0=nl.not_equal, operand0=vmax,
                           op1=nl.multiply, operand1=float(s * seg))
        nisa.tensor_tensor(dst=glob, data1=glob, data2=penalty, op=nl.add)
        best = nl.ndarray((rt, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=best, op=nl.minimum, data=glob, axis=1)
        nisa.dma_copy(dst=idx_out[r0:r0 + rt], src=best)
        if val_out is not None:
            nisa.dma_copy(dst=val_out[r0:r0 + rt], src=vmax)


@nki.jit
def rank_argmax_kernel(logits):
    """logits: HBM [R, V_local] (the entry point flattens leading dims) -> (values [R], indices [R] int32)."""
    rows, vocab = logits.shape
    values = nl.ndarray((rows,), dtype=logits.dtype, buffer=nl.shared_hbm)
    index = nl.ndarray((rows,), dtype=nl.int32, buffer=nl.shared_hbm)
    argmax_rows(logits, rows, vocab, index, values)
    return values, index
