"""Voxtral in plain PyTorch: Whisper-style audio encoder + projector + Llama decoder with a static KV cache.

Parameter names follow the HF checkpoint (after `checkpoint.convert_hf_to_neuron_state_dict`), so a state dict
loads with `load_state_dict(strict=True)`. Nothing here depends on transformers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import AudioEncoderConfig, TextConfig, VoxtralConfig
from .cpu_kernels import decode_attention, use_cpu_ops
from .kernels import ops
from .tp import SINGLE, Comm, Layout, layout, vocab_greedy


# ---------------------------------------------------------------- audio encoder

class EncoderAttention(nn.Module):
    def __init__(self, dim: int, heads: int, comm: Comm = SINGLE):
        super().__init__()
        self.heads, self.head_dim = heads // comm.size, dim // heads
        self.q_proj = comm.column(dim, dim)
        self.k_proj = comm.column(dim, dim, bias=False)
        self.v_proj = comm.column(dim, dim)
        self.out_proj = comm.row(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # scale q before the product, as Whisper does: it changes rounding, and we compare against it
        q = (self.q_proj(x) * f32(self.head_dim ** -0.5, x)).view(b, t, self.heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.heads, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig, comm: Comm = SINGLE):
        super().__init__()
        d = cfg.hidden_size
        self.self_attn = EncoderAttention(d, cfg.num_heads, comm)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = comm.column(d, cfg.intermediate_size)
        self.fc2 = comm.row(cfg.intermediate_size, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    """mel [n_chunks, n_mels, 2*P] -> hidden [n_chunks, P, d] (P = max_source_positions)."""

    def __init__(self, cfg: AudioEncoderConfig, comm: Comm = SINGLE):
        super().__init__()
        d = cfg.hidden_size
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, d)
        self.layers = nn.ModuleList(EncoderLayer(cfg, comm) for _ in range(cfg.num_layers))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv1(mel.to(self.conv1.weight.dtype)))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        x = x + self.embed_positions.weight.to(x.dtype)
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class Projector(nn.Module):
    def __init__(self, audio_intermediate: int, hidden: int, comm: Comm = SINGLE):
        super().__init__()
        self.linear_1 = comm.column(audio_intermediate, hidden, bias=False)
        self.linear_2 = comm.row(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


# ---------------------------------------------------------------- decoder

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + f32(self.eps, x))
        return self.weight * x32.to(x.dtype)


def f32(value: float, like: torch.Tensor) -> torch.Tensor:
    """value as a float32 0-d tensor, for fp32 math. Not a Python float: TorchNeuron's torch-mlir import makes a
    Python float an f64 constant that its dtype pass leaves inconsistent (the rehearsal kit's finding 4)."""
    return torch.tensor(value, dtype=torch.float32, device=like.device)


def rope_at(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] (float32) at integer positions [T], computed inside the graph: a table held as a
    buffer would be neither a checkpoint weight nor written state, and NxD initialises such tensors to zeros."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / f32(head_dim,
                                                                                                         positions)
    inv_freq = torch.reciprocal(f32(theta, positions) ** exponents)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, t, D]; cos/sin [t, D] (float32)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos.to(x.dtype) + rotated * sin.to(x.dtype))


def rope_rows(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [b, 1, T, head_dim] for positions [b, T]: broadcast over the heads of [b, heads, T, head_dim]."""
    b, t = positions.shape
    cos, sin = rope_at(positions.reshape(-1), head_dim, theta)
    return cos.view(b, 1, t, head_dim), sin.view(b, 1, t, head_dim)


def cache_rows(x: torch.Tensor) -> torch.Tensor:
    """[b, heads, T, D] -> [1, heads, b*T, D]: the rows of b sequences in the order `slot_rows` numbers them."""
    b, h, t, d = x.shape
    return x.transpose(0, 1).reshape(1, h, b * t, d)


def slot_rows(slots: torch.Tensor, positions: torch.Tensor, slot_len: int) -> torch.Tensor:
    """Cache rows [b*T] (int64) of positions [b, T] in the sequences' slots [b]: slot s owns rows s*slot_len.."""
    return (slots.long()[:, None] * slot_len + positions.long()).reshape(-1)


def gather_keys(store: torch.Tensor, key_base: torch.Tensor, s: int) -> torch.Tensor:
    """store [1, H, R, D], key_base [b] -> [b, H, s, D]: rows key_base[i] .. key_base[i]+s-1 of each sequence."""
    _, h, _, d = store.shape
    b = key_base.shape[0]
    idx = (key_base.long()[:, None] + torch.arange(s, device=store.device)).reshape(-1)
    return store.index_select(2, idx).view(h, b, s, d).transpose(0, 1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """q [b, Hq, T, D]; k, v [b, Hkv, S, D] (each sequence's own keys); visible [b, T, S] bool -> [b, T, Hq*D].
    GQA without repeating k/v. Row-invariant on CPU (see cpu_kernels.decode_attention)."""
    b, hq, t, d = q.shape
    if not use_cpu_ops(q, b * t):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], enable_gqa=hq != k.shape[1])
        return out.transpose(1, 2).reshape(b, t, hq * d)
    s = k.shape[2]
    key_base = torch.arange(b, device=q.device) * s
    return decode_attention(q, cache_rows(k), cache_rows(v), visible, key_base).reshape(b, t, hq * d)


def cached_attention(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, key_base: torch.Tensor,
                     visible: torch.Tensor) -> torch.Tensor:
    """attention over each sequence's slot of the cache: q [b, Hq, T, D]; k_store, v_store [1, Hkv, R, D]; sequence
    i reads rows key_base[i] .. key_base[i]+S-1 (S = visible's last dim). On CPU the kernel reads the slot in place;
    elsewhere the slots are gathered first (a copy of b x S rows, small beside the weights a step streams)."""
    b, hq, t, d = q.shape
    s = visible.shape[-1]
    if not use_cpu_ops(q, b * t):
        return attention(q, gather_keys(k_store, key_base, s), gather_keys(v_store, key_base, s), visible)
    return decode_attention(q, k_store, v_store, visible, key_base).reshape(b, t, hq * d)


class DecoderAttention(nn.Module):
    def __init__(self, cfg: TextConfig, lay: Layout, comm: Comm = SINGLE):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = lay.heads, lay.kv_heads, cfg.head_dim
        self.q_proj = comm.column(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = comm.kv_column(cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim)
        self.v_proj = comm.kv_column(cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim)
        self.o_proj = comm.row(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, rows, k_cache, v_cache, key_base, visible):
        """Writes this call's K/V into the cache rows `rows` [b*T] (in place), then attends.

        key_base is None: attend only to this call's own K/V (prefill from position 0);
        else sequence i attends to cache rows key_base[i].. (its slot, the KV bucket long), which already hold
        this call's K/V.
        """
        b, t = x.shape[:2]
        q = apply_rope(self.q_proj(x).view(b, t, self.n_heads, -1).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_proj(x).view(b, t, self.n_kv, -1).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(b, t, self.n_kv, -1).transpose(1, 2)
        k_cache.index_copy_(2, rows, cache_rows(k).to(k_cache.dtype))
        v_cache.index_copy_(2, rows, cache_rows(v).to(v_cache.dtype))
        if key_base is None:
            return self.o_proj(attention(q, k, v, visible))
        return self.o_proj(cached_attention(q, k_cache, v_cache, key_base, visible))


class MLP(nn.Module):
    def __init__(self, cfg: TextConfig, lay: Layout, comm: Comm = SINGLE):
        super().__init__()
        self.gate_proj = comm.column(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = comm.column(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = comm.row(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, lay: Layout, comm: Comm = SINGLE):
        super().__init__()
        self.self_attn = DecoderAttention(cfg, lay, comm)
        self.mlp = MLP(cfg, lay, comm)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, rows, k_cache, v_cache, key_base, visible):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, rows, k_cache, v_cache, key_base, visible)
        return x + self.mlp(self.post_attention_layernorm(x))


class LanguageModel(nn.Module):
    """Llama decoder body. The KV cache is a pair of buffers [layers, 1, n_kv, slots * slot_len, head_dim] updated by
    index: slot s (one sequence of a batch) owns rows s*slot_len .. (s+1)*slot_len - 1. Slots along the row
    dimension, not a dimension of their own, so that a write is one index_copy_ whatever the batch."""

    def __init__(self, cfg: TextConfig, max_len: int, lay: Layout, comm: Comm = SINGLE, slots: int = 1):
        super().__init__()
        self.cfg, self.slot_len, self.slots = cfg, max_len, slots
        self.embed_tokens = comm.vocab_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, lay, comm) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        shape = (cfg.num_layers, 1, lay.kv_heads, slots * max_len, cfg.head_dim)
        self.register_buffer("k_cache", torch.empty(shape), persistent=False)
        self.register_buffer("v_cache", torch.empty(shape), persistent=False)
        self.init_state(self.k_cache.device)

    def init_state(self, device="cpu", dtype=None) -> None:
        """(Re)allocate zeroed caches, e.g. after loading weights into a meta model."""
        self.k_cache = torch.zeros(self.k_cache.shape, dtype=dtype or self.k_cache.dtype, device=device)
        self.v_cache = torch.zeros(self.v_cache.shape, dtype=dtype or self.v_cache.dtype, device=device)

    def forward(self, x, positions, slots, key_len, visible, capture_layers=()):
        """x [b, T, H] embeddings at `positions` [b, T] (int) of the sequences in cache slots `slots` [b] ->
        (final-normed hidden [b, T, H], captured outputs). key_len None: prefill (attend to this call's own K/V);
        else each sequence attends to the first key_len rows of its slot. visible [b, T, key_len or T] bool.

        captured = outputs of the decoder layers listed in capture_layers (DFlash context features).
        """
        cos, sin = rope_rows(positions, self.cfg.head_dim, self.cfg.rope_theta)
        rows = slot_rows(slots, positions, self.slot_len)
        key_base = None if key_len is None else slots.long() * self.slot_len
        captured = []
        for i, layer in enumerate(self.layers):
            # select, not [i]: TorchNeuron's aliasing analysis follows select as a view of the cache buffer (an
            # integer index it does not), so the cache write becomes an in-place must_alias pair, not a copy-back
            x = layer(x, cos, sin, rows, self.k_cache.select(0, i), self.v_cache.select(0, i), key_base, visible)
            if i in capture_layers:
                captured.append(x)
        return self.norm(x), captured


def causal_visible(t: int, device) -> torch.Tensor:
    """[1, t, t]: a prefill of t tokens (one sequence)."""
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()[None]


def cached_visible(positions: torch.Tensor, cache_mask: torch.Tensor, start=None) -> torch.Tensor:
    """Which rows of its slot each new token may read -> [b, T, S] bool. positions [b, T] are consecutive per
    sequence; cache_mask [b, S] (int, 1 = a valid row written before this call). New tokens also see the rows this
    call wrote from `start` [b] (default: each sequence's first position) up to themselves. Rows past the valid
    length (rejected speculation, padding) are never visible."""
    rows = torch.arange(cache_mask.shape[1], device=positions.device)[None, None, :]
    pos = positions.long()[:, :, None]
    first = pos[:, :1] if start is None else start.long()[:, None, None]
    return (cache_mask[:, None, :] > 0) | ((rows >= first) & (rows <= pos))


class VoxtralModel(nn.Module):
    """comm: the tensor-parallel group (tp.py); the default is the whole model on one rank. The structure is the
    same on every rank (SPMD): which shard a rank holds is in its weights, including its SPMDRank."""

    def __init__(self, cfg: VoxtralConfig, max_len: int, comm: Comm = SINGLE, slots: int = 1):
        super().__init__()
        self.cfg, self.comm = cfg, comm
        self.layout = lay = layout(cfg.text, cfg.audio, comm.size, 0)
        audio_comm = comm if lay.audio_sharded else SINGLE  # replicated: no reductions
        self.audio_tower = AudioEncoder(cfg.audio, audio_comm)
        self.multi_modal_projector = Projector(cfg.audio.intermediate_size, cfg.text.hidden_size, audio_comm)
        self.language_model = LanguageModel(cfg.text, max_len, lay, comm, slots)
        self.lm_head = comm.vocab_head(cfg.text.hidden_size, cfg.text.vocab_size)
        self.spmd_rank = comm.spmd_rank()

    def init_state(self, device="cpu", dtype=None) -> None:
        self.language_model.init_state(device, dtype)

    def greedy(self, h: torch.Tensor) -> torch.Tensor:
        """Greedy tokens (int32) of final hidden states h [..., H]: argmax over the whole (sharded) vocabulary."""
        rank = self.spmd_rank.rank if self.spmd_rank is not None else None
        return vocab_greedy(self.lm_head(h), rank, self.cfg.text.vocab_size, self.comm)

    def encode_audio(self, mel: torch.Tensor) -> torch.Tensor:
        """mel [n, n_mels, frames] -> audio embeddings [n * tokens_per_chunk, H]."""
        h = self.audio_tower(mel)
        return self.multi_modal_projector(h.reshape(-1, self.cfg.audio.intermediate_size))

    def embed_with_audio(self, input_ids, audio_embeds, audio_positions):
        """Token embeddings with audio embeddings written at audio_positions by index (no masked_scatter).

        Padding entries of audio_positions point at row T (one past the prompt): a scratch row that is dropped."""
        x = self.language_model.embed_tokens(input_ids.long())[0]
        x = torch.cat([x, x.new_zeros(1, x.shape[1])], dim=0)
        return ops.splice(x, audio_embeds.to(x.dtype), audio_positions)[:-1].unsqueeze(0)
