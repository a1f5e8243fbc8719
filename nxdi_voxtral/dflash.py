"""DFlash block-diffusion draft (the public DFlashDraftModel checkpoint format, Qwen3-style layers).

It has no embeddings and no LM head: the block is embedded with the target's embeddings and proposals come
from the target's LM head. Its KV cache holds context rows only (target features of accepted positions).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .errors import CheckpointError, DraftMismatchError
from .model import MLP, DecoderAttention, RMSNorm, apply_rope, attention, cache_rows, gather_keys, rope_rows, slot_rows
from .config import TextConfig
from .tp import SINGLE, Comm, Layout, layout


@dataclass(frozen=True)
class DFlashConfig:
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_target_layers: int
    text: TextConfig  # the draft's own layer shapes (num_layers = draft layers)

    @classmethod
    def from_dir(cls, draft_dir: str | Path) -> "DFlashConfig":
        path = Path(draft_dir) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{draft_dir}: no config.json (expected a DFlash draft checkpoint)")
        try:
            d = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(d, dict) or not isinstance(d.get("dflash_config") or {}, dict):
            raise CheckpointError(f"{path}: expected a JSON object with a dflash_config object")
        dc = d.get("dflash_config") or {}
        missing = [k for k in ("block_size", "num_hidden_layers", "hidden_size") if k not in d]
        missing += [f"dflash_config.{k}" for k in ("target_layer_ids", "mask_token_id") if k not in dc]
        if missing:
            raise CheckpointError(f"{path}: not a DFlash config, missing {', '.join(missing)}")
        heads = d.get("num_attention_heads", 32)
        rope = d.get("rope_parameters") or {}
        text = TextConfig(vocab_size=d.get("vocab_size", 0), hidden_size=d["hidden_size"],
                          intermediate_size=d.get("intermediate_size", 4 * d["hidden_size"]),
                          num_layers=d["num_hidden_layers"], num_heads=heads,
                          num_kv_heads=d.get("num_key_value_heads", heads),
                          head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                          rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 1e6))),
                          rms_norm_eps=d.get("rms_norm_eps", 1e-6))
        return cls(block_size=int(d["block_size"]), target_layer_ids=tuple(int(i) for i in dc["target_layer_ids"]),
                   mask_token_id=int(dc["mask_token_id"]), num_target_layers=int(d.get("num_target_layers", 0)),
                   text=text)

    def check_against(self, target: TextConfig, k: int) -> None:
        if self.text.hidden_size != target.hidden_size:
            raise DraftMismatchError(f"DFlash hidden size {self.text.hidden_size} != target's {target.hidden_size}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise DraftMismatchError(f"DFlash target_layer_ids {bad} out of range for a {target.num_layers}-layer target")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise DraftMismatchError(f"DFlash mask_token_id {self.mask_token_id} is outside the target vocabulary "
                                     f"(0..{target.vocab_size - 1})")
        if self.text.vocab_size and self.text.vocab_size != target.vocab_size:
            raise DraftMismatchError(f"DFlash vocab_size {self.text.vocab_size} != target's {target.vocab_size}")
        if not 1 <= k <= self.block_size - 1:
            raise DraftMismatchError(f"num_speculative_tokens={k} but a DFlash block of {self.block_size} "
                                     f"proposes at most {self.block_size - 1}")


class DFlashAttention(DecoderAttention):
    """The decoder's projections plus Qwen3's per-head q/k RMSNorm (before RoPE); no causal mask."""

    def __init__(self, cfg: TextConfig, lay: Layout, comm: Comm):
        super().__init__(cfg, lay, comm)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def keys_values(self, x, cos, sin):
        b, t = x.shape[:2]
        k = self.k_norm(self.k_proj(x).view(b, t, self.n_kv, -1)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, -1).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, k_ctx, v_ctx, visible):
        """Block rows x [b, B, H] attend to [context [b, n_kv, S, D] ; the block itself], no causal mask."""
        b, t = x.shape[:2]
        q = apply_rope(self.q_norm(self.q_proj(x).view(b, t, self.n_heads, -1)).transpose(1, 2), cos, sin)
        k, v = self.keys_values(x, cos, sin)
        keys = torch.cat([k_ctx, k.to(k_ctx.dtype)], dim=2)
        values = torch.cat([v_ctx, v.to(v_ctx.dtype)], dim=2)
        return self.o_proj(attention(q, keys, values, visible))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: TextConfig, lay: Layout, comm: Comm):
        super().__init__()
        self.self_attn = DFlashAttention(cfg, lay, comm)
        self.mlp = MLP(cfg, lay, comm)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DFlashDraft(nn.Module):
    """The cache holds context rows in slots, as the target's (model.LanguageModel): slot s owns rows
    s*slot_len .. (s+1)*slot_len - 1."""

    def __init__(self, cfg: DFlashConfig, max_len: int, comm: Comm = SINGLE, slots: int = 1):
        super().__init__()
        self.cfg, self.slot_len = cfg, max_len
        t = cfg.text
        self.layout = lay = layout(t, None, comm.size, 0)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * t.hidden_size, t.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(t.hidden_size, t.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(t, lay, comm) for _ in range(t.num_layers))
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps)
        shape = (t.num_layers, 1, lay.kv_heads, slots * max_len, t.head_dim)
        self.register_buffer("k_cache", torch.empty(shape), persistent=False)
        self.register_buffer("v_cache", torch.empty(shape), persistent=False)
        self.init_state(self.k_cache.device)

    def init_state(self, device="cpu", dtype=None) -> None:
        self.k_cache = torch.zeros(self.k_cache.shape, dtype=dtype or self.k_cache.dtype, device=device)
        self.v_cache = torch.zeros(self.v_cache.shape, dtype=dtype or self.v_cache.dtype, device=device)

    def rope(self, positions):
        return rope_rows(positions, self.cfg.text.head_dim, self.cfg.text.rope_theta)

    def write_context(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """features [b, R, n_ids*H] of target positions `positions` [b, R] of the sequences in `slots` [b] ->
        context K/V of every layer, in place."""
        ctx = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        cos, sin = self.rope(positions)
        rows = slot_rows(slots, positions, self.slot_len)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.keys_values(ctx, cos, sin)
            # select, not [i]: the in-place write must stay a view of the buffer for TorchNeuron (model.py)
            self.k_cache.select(0, i).index_copy_(2, rows, cache_rows(k).to(self.k_cache.dtype))
            self.v_cache.select(0, i).index_copy_(2, rows, cache_rows(v).to(self.v_cache.dtype))

    def propose_hidden(self, block: torch.Tensor, positions: torch.Tensor, ctx_mask: torch.Tensor,
                       slots: torch.Tensor) -> torch.Tensor:
        """block [b, B, H] embedded at positions [b, B]; ctx_mask [b, S] marks valid context rows of each sequence's
        slot -> norm(x) [b, B, H]."""
        (n, s), blk = ctx_mask.shape, block.shape[1]
        visible = torch.cat([(ctx_mask[:, None, :] > 0).expand(n, blk, s),
                             torch.ones(n, blk, blk, dtype=torch.bool, device=block.device)], dim=2)
        cos, sin = self.rope(positions)
        key_base = slots.long() * self.slot_len
        x = block
        for i, layer in enumerate(self.layers):
            k_ctx = gather_keys(self.k_cache.select(0, i), key_base, s)
            v_ctx = gather_keys(self.v_cache.select(0, i), key_base, s)
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, k_ctx, v_ctx, visible)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)
