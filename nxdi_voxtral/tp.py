"""Tensor parallelism, the NxD way (docs/design.md §6), written with plain torch.distributed.

One sharding description (`shard_spec`) drives both backends: on CPU ranks are processes with gloo collectives;
on Neuron the same description becomes NxD parallel layers / partition_dim attributes.
  column-parallel (dim 0): q/k/v, gate/up, audio q/k/v/fc1, projector linear_1
  row-parallel (dim 1) + all-reduce: o_proj, down_proj, audio out_proj/fc2, projector linear_2
  vocab-parallel (dim 0, padded to a multiple of tp): embed_tokens, lm_head (argmax combined across ranks)
  kv heads: split when tp <= n_kv, replicated (rank r holds head r // (tp / n_kv)) when tp > n_kv
  rank (SPMDRank weights): arange(tp) split on dim 0, so the rank is data in a graph every rank shares
  everything else (norms, convs, positions, DFlash fc): replicated
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from .cpu_kernels import row_linear, use_cpu_ops
from .errors import ConfigError


class Comm:
    """Single rank: collectives are identities."""
    rank, size = 0, 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """-> [size, *x.shape]"""
        return x.unsqueeze(0)

    # Layer construction. Sizes are the whole model's; CPU modules hold this rank's share of them. The Neuron
    # backend's NxDComm (neuron.py) returns NxD's parallel layers instead, which shard through NxD's checkpoint path.
    def column(self, in_features: int, out_features: int, bias: bool = True) -> nn.Module:
        return Linear(in_features, out_features // self.size, bias=bias)

    def row(self, in_features: int, out_features: int, bias: bool = True) -> nn.Module:
        return RowLinear(in_features // self.size, out_features, bias=bias, comm=self)

    def kv_column(self, in_features: int, n_kv: int, head_dim: int) -> nn.Module:
        """k/v projection: kv heads split across ranks, or one replicated head per rank when size > n_kv."""
        return Linear(in_features, max(n_kv // self.size, 1) * head_dim, bias=False)

    def vocab_embedding(self, vocab: int, dim: int) -> nn.Module:
        return VocabEmbedding(math.ceil(vocab / self.size), dim, self)

    def vocab_head(self, dim: int, vocab: int) -> nn.Module:
        return Linear(dim, math.ceil(vocab / self.size), bias=False)

    def spmd_rank(self) -> nn.Module | None:
        return SPMDRank() if self.size > 1 else None


class SPMDRank(nn.Module):
    """This rank's index as a weight ([1] int32, checkpoint value arange(tp) sharded on dim 0), as NxD's SPMDRank:
    one traced graph serves every rank, so nothing rank-specific may be a Python constant in it."""

    def __init__(self):
        super().__init__()
        self.rank = nn.Parameter(torch.zeros(1, dtype=torch.int32), requires_grad=False)


class DistComm(Comm):
    """The default torch.distributed group (gloo on CPU), through functional collectives: they run eagerly and
    are traced by torch.export, so exported per-rank graphs keep their collectives."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def all_reduce(self, x):
        """Sum over ranks in rank order, accumulated in fp32: gloo's all-reduce splits the tensor into chunks by
        size and adds them in an order that depends on the chunk, so with tp > 2 a row's sum would change with
        the row count. Gathering costs tp x the bytes, which for decode / verify activations is nothing."""
        parts = self.all_gather(x)
        total = parts[0].float()
        for r in range(1, self.size):
            total = total + parts[r].float()
        return total.to(x.dtype)

    def all_gather(self, x):
        return _waited(funcol.all_gather_tensor(x.contiguous(), 0, dist.group.WORLD)).reshape(self.size, *x.shape)


def _waited(t):
    # eager funcol results are async handles; wait now so no later (in-place) op races the collective
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


SINGLE = Comm()


@dataclass(frozen=True)
class Layout:
    """Per-rank sizes of one model for tp ranks."""
    tp: int
    rank: int
    heads: int
    kv_heads: int
    kv_replicated: bool
    intermediate: int
    vocab_local: int
    audio_sharded: bool
    n_kv: int          # kv heads of the whole model
    head_dim: int


def layout(text, audio, tp: int, rank: int) -> Layout:
    nh, nkv = text.num_heads, text.num_kv_heads
    if nh % tp:
        raise ConfigError(f"tp={tp} must divide the number of attention heads ({nh})")
    if not (nkv % tp == 0 or tp % nkv == 0):
        raise ConfigError(f"tp={tp} must divide or be a multiple of the number of kv heads ({nkv})")
    if text.intermediate_size % tp:
        raise ConfigError(f"tp={tp} must divide the MLP size ({text.intermediate_size})")
    audio_sharded = audio is not None and tp > 1 and audio.num_heads % tp == 0 and audio.intermediate_size % tp == 0 \
        and text.hidden_size % tp == 0
    return Layout(tp, rank, nh // tp, max(nkv // tp, 1), tp > nkv, text.intermediate_size // tp,
                  math.ceil(text.vocab_size / tp) if text.vocab_size else 0, audio_sharded, nkv, text.head_dim)


_ROW = re.compile(r"(self_attn\.(o_proj|out_proj)|mlp\.down_proj|\.fc2|multi_modal_projector\.linear_2)\.weight$")
_COLUMN = re.compile(r"(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj|\.fc1|multi_modal_projector\.linear_1)\.(weight|bias)$")
_VOCAB = re.compile(r"(embed_tokens|lm_head)\.weight$")


def shard_kind(name: str, lay: Layout) -> str:
    """The sharding description: 'replicated' | 'column' | 'row' | 'vocab' | 'kv' for a parameter name.
    (NxD: column -> ColumnParallelLinear(gather_output=False), row -> RowParallelLinear(input_is_parallel=True),
    vocab -> ParallelEmbedding / vocab-parallel lm_head, kv -> column with GQA replication.)"""
    if lay.tp == 1:
        return "replicated"
    audio = name.startswith(("audio_tower.", "multi_modal_projector."))
    if audio and not lay.audio_sharded:
        return "replicated"
    if _ROW.search(name):
        return "row"
    if _VOCAB.search(name):
        return "vocab"
    if name.endswith("rank_util.rank") or name.endswith("spmd_rank.rank"):
        return "rank"
    if not audio and re.search(r"self_attn\.[kv]_proj\.weight$", name):
        return "kv"
    if _COLUMN.search(name):
        return "column"
    return "replicated"


def shard_tensor(name: str, t: torch.Tensor, lay: Layout) -> torch.Tensor:
    """The rank's shard of the full tensor `name` (our module names)."""
    kind = shard_kind(name, lay)
    if kind == "row":
        return t.chunk(lay.tp, 1)[lay.rank].clone()
    if kind == "column":
        return t.chunk(lay.tp, 0)[lay.rank].clone()
    if kind == "vocab":
        rows = lay.vocab_local * lay.tp
        if rows > t.shape[0]:  # pad the vocabulary to a multiple of tp; padded logits are masked to -inf
            t = torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])
        return t.chunk(lay.tp, 0)[lay.rank].clone()
    if kind == "rank":  # the whole-model value is arange(tp)
        return torch.tensor([lay.rank], dtype=torch.int32)
    if kind == "kv":
        if lay.kv_replicated:
            head = lay.rank // (lay.tp // lay.n_kv)
            return t[head * lay.head_dim:(head + 1) * lay.head_dim].clone()
        return t.chunk(lay.tp, 0)[lay.rank].clone()
    return t


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T, row-invariant on CPU up to ROW_INVARIANT_ROWS rows: row j of a K+1-row verify pass gets the
    bits a 1-row decode step gets for the same input, or a near-tie argmax flips between plain greedy and
    speculation (in bf16 within ~20 tokens). See cpu_kernels. Many rows, and other devices: F.linear."""
    rows = x.numel() // x.shape[-1]
    if not use_cpu_ops(x, rows):
        return F.linear(x, weight, bias)
    y = row_linear(x.reshape(rows, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[0])
    return y + bias if bias is not None else y


class Linear(nn.Linear):
    """nn.Linear (same parameters and checkpoint names) computed with `linear`."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)


class RowLinear(nn.Linear):
    """Row-parallel linear: partial products all-reduced, the bias added once after the reduction."""

    def __init__(self, in_features, out_features, bias=True, comm: Comm = SINGLE):
        super().__init__(in_features, out_features, bias=bias)
        self.comm = comm

    def forward(self, x):
        if self.comm.size == 1:
            return linear(x, self.weight, self.bias)
        y = self.comm.all_reduce(linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class VocabEmbedding(nn.Embedding):
    """Vocab-parallel embedding: ids outside this rank's range contribute zeros; all-reduce. The range start is
    rank_util.rank * rows (data, not a trace-time constant; the name mirrors NxD's ParallelEmbedding)."""

    def __init__(self, num_local, dim, comm: Comm = SINGLE):
        super().__init__(num_local, dim)
        self.comm = comm
        self.rank_util = comm.spmd_rank()

    def forward(self, ids):
        if self.comm.size == 1:
            return super().forward(ids)
        local = ids - self.rank_util.rank * self.num_embeddings
        inside = (local >= 0) & (local < self.num_embeddings)
        emb = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return self.comm.all_reduce(emb * inside.unsqueeze(-1).to(emb.dtype))


def vocab_greedy(logits: torch.Tensor, rank: torch.Tensor | None, vocab_size: int, comm: Comm) -> torch.Tensor:
    """Global argmax (first index on ties, as torch.argmax) of vocab-sharded logits [..., V_local] -> int32.
    rank: this rank's SPMDRank weight ([1] int32); the shard starts at rank * V_local."""
    from .kernels import ops  # the rank-local argmax kernel entry point (NKI on Neuron, its torch twin elsewhere)
    if comm.size == 1:
        return ops.rank_argmax(logits)[1]
    n_local = logits.shape[-1]
    valid = (rank * n_local + torch.arange(n_local, dtype=torch.int32, device=logits.device)) < vocab_size
    best, idx = ops.rank_argmax(torch.where(valid, logits, torch.full_like(logits, float("-inf"))))
    # lowest rank among equal maxima = lowest global id
    return ops.combine_rank_argmax(comm.all_gather(best), comm.all_gather(idx), n_local)
