"""Audio splice by index: NKI kernel and torch twin.

Contract (both implementations):
  splice(embeds [T+1, H], audio [A, H] (same dtype), positions [A] int32) -> [T+1, H]
  = embeds with row positions[i] replaced by audio[i]. Row T is scratch: padding entries of `positions` point
  at it and the caller drops it. Real positions are unique and in [0, T); several padding entries may share T
  (which of them lands there is undefined, as on hardware). The twin is
  `embeds.index_copy(0, positions.long(), audio)`.

Kernel tile plan: 1 DMA HBM -> HBM copies embeds into the shared_hbm output; then per block of <= 128 audio
rows: 1 DMA loads the block's positions into a (p, 1) int32 SBUF index tile, and per column tile of
<= h_tile (default 8192) elements 1 DMA stages the rows in SBUF and 1 indirect DMA (vector_offset, software
DGE, oob_mode.error) scatters them into the output rows. Instructions: 1 + ceil(A/128) * (1 + 2*ceil(H/h_tile)).
"""
from __future__ import annotations

import torch

from .nki_api import KernelArgumentError, nisa, nki, nl

PMAX = 128
H_TILE = 8192  # elements of one SBUF row tile (32 KiB fp32 per partition)


def splice_torch(embeds: torch.Tensor, audio: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return embeds.index_copy(0, positions.long(), audio)


def check_splice_args(embeds: torch.Tensor, audio: torch.Tensor, positions: torch.Tensor, values: bool):
    """Shapes and dtypes always; with values=True (host tensors only) also the index range and uniqueness."""
    if embeds.dim() != 2 or audio.dim() != 2 or audio.shape[1] != embeds.shape[1]:
        raise KernelArgumentError(f"splice: embeds [T+1, H] and audio [A, H] expected, got "
                                  f"{tuple(embeds.shape)} and {tuple(audio.shape)}")
    if audio.dtype != embeds.dtype:
        raise KernelArgumentError(f"splice: audio dtype {audio.dtype} != embeds dtype {embeds.dtype}")
    if positions.dtype != torch.int32 or tuple(positions.shape) != (audio.shape[0],):
        raise KernelArgumentError(f"splice: positions must be [{audio.shape[0]}] int32, got "
                                  f"{tuple(positions.shape)} {positions.dtype}")
    if values and positions.numel():
        scratch = embeds.shape[0] - 1
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi > scratch:
            raise KernelArgumentError(f"splice: positions must lie in [0, {scratch}] (row {scratch} is the "
                                      f"scratch row), got [{lo}, {hi}]")
        real = positions[positions != scratch]
        if torch.unique(real).numel() != real.numel():
            raise KernelArgumentError("splice: positions other than the scratch row must be unique")


@nki.jit
def splice_kernel(embeds, audio, positions, h_tile=H_TILE):
    rows, hidden = embeds.shape
    n_audio = audio.shape[0]
    out = nl.ndarray((rows, hidden), dtype=embeds.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=embeds)
    for a0 in range(0, n_audio, PMAX):
        p = min(PMAX, n_audio - a0)
        idx = nl.ndarray((p, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx, src=positions[a0:a0 + p])
        for h0 in range(0, hidden, h_tile):
            w = min(h_tile, hidden - h0)
            block = nl.ndarray((p, w), dtype=audio.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=block, src=audio[a0:a0 + p, h0:h0 + w])
            nisa.dma_copy(dst=out.ap(pattern=[[hidden, p], [1, w]], offset=h0, vector_offset=idx, indirect_dim=0),
                          src=block, oob_mode=nisa.oob_mode.error, dge_mode=nisa.dge_mode.swdge)
    return out
