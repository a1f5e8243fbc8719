"""Voxtral in plain PyTorch: Whisper-style audio encoder + projector + Llama decoder with a static KV cache.

Parameter names follow the HF checkpoint (after `checkpoint.convert_hf_to_neuron_state_dict`), so a state dict
loads with `load_state_dict(strict=True)`. Nothing here depends on transformers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import AudioEncoderConfig, TextConfig, VoxtralConfig
from .tp import SINGLE, Comm, Layout, Linear, RowLinear, VocabEmbedding, layout, vocab_greedy


# ---------------------------------------------------------------- audio encoder

class EncoderAttention(nn.Module):
    def __init__(self, dim: int, heads: int, tp: int = 1, comm: Comm = SINGLE):
        super().__init__()
        self.heads, self.head_dim = heads // tp, dim // heads
        local = dim // tp
        self.q_proj = nn.Linear(dim, local)
        self.k_proj = nn.Linear(dim, local, bias=False)
        self.v_proj = nn.Linear(dim, local)
        self.out_proj = RowLinear(local, dim, comm=comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # scale q before the product, as Whisper does: it changes rounding, and we compare against it
        q = (self.q_proj(x) * self.head_dim ** -0.5).view(b, t, self.heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.heads, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig, tp: int = 1, comm: Comm = SINGLE):
        super().__init__()
        d = cfg.hidden_size
        self.self_attn = EncoderAttention(d, cfg.num_heads, tp, comm)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, cfg.intermediate_size // tp)
        self.fc2 = RowLinear(cfg.intermediate_size // tp, d, comm=comm)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    """mel [n_chunks, n_mels, 2*P] -> hidden [n_chunks, P, d] (P = max_source_positions)."""

    def __init__(self, cfg: AudioEncoderConfig, tp: int = 1, comm: Comm = SINGLE):
        super().__init__()
        d = cfg.hidden_size
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, d)
        self.layers = nn.ModuleList(EncoderLayer(cfg, tp, comm) for _ in range(cfg.num_layers))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv1(mel.to(self.conv1.weight.dtype)))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        x = x + self.embed_positions.weight.to(x.dtype)
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class Projector(nn.Module):
    def __init__(self, audio_intermediate: int, hidden: int, tp: int = 1, comm: Comm = SINGLE):
        super().__init__()
        self.linear_1 = nn.Linear(audio_intermediate, hidden // tp, bias=False)
        self.linear_2 = RowLinear(hidden // tp, hidden, bias=False, comm=comm)

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
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_tables(head_dim: int, theta: float, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, t, D]; cos/sin [t, D] (float32)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos.to(x.dtype) + rotated * sin.to(x.dtype))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """q [1, Hq, T, D]; k, v [1, Hkv, S, D]; visible [T, S] bool -> [1, T, Hq*D]. GQA without repeating k/v."""
    _, hq, t, d = q.shape
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=hq != k.shape[1])
    return out.transpose(1, 2).reshape(1, t, hq * d)


class DecoderAttention(nn.Module):
    def __init__(self, cfg: TextConfig, lay: Layout, comm: Comm = SINGLE):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = lay.heads, lay.kv_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, lay.heads * cfg.head_dim, bias=False)
        self.k_proj = Linear(cfg.hidden_size, lay.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = Linear(cfg.hidden_size, lay.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = RowLinear(lay.heads * cfg.head_dim, cfg.hidden_size, bias=False, comm=comm)

    def forward(self, x, cos, sin, write_pos, k_cache, v_cache, key_len, visible):
        """Writes this call's K/V into the caches at `write_pos` (in place), then attends.

        key_len is None: attend only to this call's own K/V (prefill from position 0);
        else attend to cache[:key_len] (the KV bucket), which already holds this call's K/V.
        """
        t = x.shape[1]
        q = apply_rope(self.q_proj(x).view(1, t, self.n_heads, -1).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_proj(x).view(1, t, self.n_kv, -1).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(1, t, self.n_kv, -1).transpose(1, 2)
        k_cache.index_copy_(2, write_pos, k.to(k_cache.dtype))
        v_cache.index_copy_(2, write_pos, v.to(v_cache.dtype))
        if key_len is not None:
            k, v = k_cache[:, :, :key_len], v_cache[:, :, :key_len]
        return self.o_proj(attention(q, k, v, visible))


class MLP(nn.Module):
    def __init__(self, cfg: TextConfig, lay: Layout, comm: Comm = SINGLE):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, lay.intermediate, bias=False)
        self.up_proj = Linear(cfg.hidden_size, lay.intermediate, bias=False)
        self.down_proj = RowLinear(lay.intermediate, cfg.hidden_size, bias=False, comm=comm)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, lay: Layout, comm: Comm = SINGLE):
        super().__init__()
        self.self_attn = DecoderAttention(cfg, lay, comm)
        self.mlp = MLP(cfg, lay, comm)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, write_pos, k_cache, v_cache, key_len, visible):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, write_pos, k_cache, v_cache, key_len, visible)
        return x + self.mlp(self.post_attention_layernorm(x))


class LanguageModel(nn.Module):
    """Llama decoder body. The KV cache is a pair of buffers [layers, 1, n_kv, max_len, head_dim] updated by index."""

    def __init__(self, cfg: TextConfig, max_len: int, lay: Layout, comm: Comm = SINGLE):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = VocabEmbedding(lay.vocab_local, cfg.hidden_size, lay.rank * lay.vocab_local, comm)
        self.layers = nn.ModuleList(DecoderLayer(cfg, lay, comm) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("rope_cos", torch.empty(max_len, cfg.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(max_len, cfg.head_dim), persistent=False)
        shape = (cfg.num_layers, 1, lay.kv_heads, max_len, cfg.head_dim)
        self.register_buffer("k_cache", torch.empty(shape), persistent=False)
        self.register_buffer("v_cache", torch.empty(shape), persistent=False)
        self.init_state(self.k_cache.device)

    def init_state(self, device="cpu", dtype=None) -> None:
        """(Re)allocate the RoPE tables (float32) and zeroed caches, e.g. after loading weights into a meta model."""
        self.rope_cos, self.rope_sin = (t.to(device) for t in rope_tables(self.cfg.head_dim, self.cfg.rope_theta,
                                                                           self.max_len))
        self.k_cache = torch.zeros(self.k_cache.shape, dtype=dtype or self.k_cache.dtype, device=device)
        self.v_cache = torch.zeros(self.v_cache.shape, dtype=dtype or self.v_cache.dtype, device=device)

    @property
    def max_len(self) -> int:
        return self.k_cache.shape[3]

    def forward(self, x, positions, key_len, visible, capture_layers=()):
        """x [1, T, H] embeddings at `positions` [T] (int) -> (final-normed hidden [1, T, H], captured outputs).

        captured = outputs of the decoder layers listed in capture_layers (DFlash context features).
        """
        pos = positions.long()
        cos, sin = self.rope_cos.index_select(0, pos), self.rope_sin.index_select(0, pos)
        captured = []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, pos, self.k_cache[i], self.v_cache[i], key_len, visible)
            if i in capture_layers:
                captured.append(x)
        return self.norm(x), captured


def causal_visible(t: int, device=None) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()


def cached_visible(positions: torch.Tensor, cache_mask: torch.Tensor, start=None) -> torch.Tensor:
    """Which cache slots each new token may read. positions [T] are consecutive; cache_mask [1, S] (int, 1 = a
    valid slot written before this call). New tokens also see the slots this call wrote from `start` (default:
    the first position) up to themselves. Slots past the valid length (rejected speculation, padding) are
    never visible."""
    slots = torch.arange(cache_mask.shape[1], device=positions.device)
    pos = positions.long()
    first = pos[0] if start is None else start.long()
    in_block = (slots[None, :] >= first) & (slots[None, :] <= pos[:, None])
    return (cache_mask > 0) | in_block


class VoxtralModel(nn.Module):
    """tp / rank / comm: this rank's shard (tp.py); the default is the whole model on one rank."""

    def __init__(self, cfg: VoxtralConfig, max_len: int, tp: int = 1, rank: int = 0, comm: Comm = SINGLE):
        super().__init__()
        self.cfg, self.comm = cfg, comm
        self.layout = lay = layout(cfg.text, cfg.audio, tp, rank)
        audio_tp, audio_comm = (tp, comm) if lay.audio_sharded else (1, SINGLE)  # replicated: no reductions
        self.audio_tower = AudioEncoder(cfg.audio, audio_tp, audio_comm)
        self.multi_modal_projector = Projector(cfg.audio.intermediate_size, cfg.text.hidden_size, audio_tp, audio_comm)
        self.language_model = LanguageModel(cfg.text, max_len, lay, comm)
        self.lm_head = Linear(cfg.text.hidden_size, lay.vocab_local, bias=False)

    def init_state(self, device="cpu", dtype=None) -> None:
        self.language_model.init_state(device, dtype)

    def greedy(self, h: torch.Tensor) -> torch.Tensor:
        """Greedy tokens (int32) of final hidden states h [..., H]: argmax over the whole (sharded) vocabulary."""
        lay = self.layout
        return vocab_greedy(self.lm_head(h), lay.rank * lay.vocab_local, self.cfg.text.vocab_size, self.comm)

    def encode_audio(self, mel: torch.Tensor) -> torch.Tensor:
        """mel [n, n_mels, frames] -> audio embeddings [n * tokens_per_chunk, H]."""
        h = self.audio_tower(mel)
        return self.multi_modal_projector(h.reshape(-1, self.cfg.audio.intermediate_size))

    def embed_with_audio(self, input_ids, audio_embeds, audio_positions):
        """Token embeddings with audio embeddings written at audio_positions by index (no masked_scatter).

        Padding entries of audio_positions point at row T (one past the prompt): a scratch row that is dropped."""
        x = self.language_model.embed_tokens(input_ids.long())[0]
        x = torch.cat([x, x.new_zeros(1, x.shape[1])], dim=0)
        x = x.index_copy(0, audio_positions.long(), audio_embeds.to(x.dtype))
        return x[:-1].unsqueeze(0)
