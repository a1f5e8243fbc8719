"""The graphs: the single source of truth for tags, buckets and input signatures.

Every graph is an nn.Module whose forward takes positional fixed-shape tensors (int32 ids and indices) and
returns a tuple of tensors. The KV caches are buffers of the shared model, updated in place. `compile.build`
and the runtime both enumerate graphs through `graph_plan` and build inputs through `example_inputs`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .config import VoxtralConfig
from .errors import AudioTooLongError, ConfigError
from .model import VoxtralModel, causal_visible, cached_visible

I32 = torch.int32


@dataclass(frozen=True)
class Buckets:
    audio_chunks: tuple[int, ...] = (1, 2, 4, 10)            # 30 s chunks: up to 5 minutes
    kv_lengths: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)
    text_slack: int = 64  # prompt tokens that are not audio: [BOS][INST][BEGIN_AUDIO] ... [/INST] lang:xx [TRANSCRIBE]

    def __post_init__(self):
        if not self.audio_chunks or list(self.audio_chunks) != sorted(set(self.audio_chunks)):
            raise ConfigError(f"audio_chunks buckets must be increasing and non-empty, got {self.audio_chunks}")
        if not self.kv_lengths or list(self.kv_lengths) != sorted(set(self.kv_lengths)):
            raise ConfigError(f"kv_lengths buckets must be increasing and non-empty, got {self.kv_lengths}")

    def prompt_length(self, n_chunks: int, cfg: VoxtralConfig) -> int:
        return n_chunks * cfg.audio.tokens_per_chunk + self.text_slack

    def chunk_bucket(self, n_chunks: int, cfg: VoxtralConfig) -> int:
        for b in self.audio_chunks:
            if b >= n_chunks:
                return b
        limit = self.audio_chunks[-1] * cfg.audio.mel_frames_per_chunk // 100
        raise AudioTooLongError(
            f"audio needs {n_chunks} chunks of 30 s but the largest audio bucket holds {self.audio_chunks[-1]} "
            f"({limit} s); rebuild with a larger audio_chunks bucket")

    def kv_bucket(self, length: int) -> int:
        for b in self.kv_lengths:
            if b >= length:
                return b
        raise ConfigError(f"sequence of {length} tokens exceeds the largest KV bucket ({self.kv_lengths[-1]})")

    def validate(self, cfg: VoxtralConfig) -> None:
        longest_prompt = self.prompt_length(self.audio_chunks[-1], cfg)
        if longest_prompt >= self.kv_lengths[-1]:
            raise ConfigError(f"largest KV bucket {self.kv_lengths[-1]} cannot hold the longest prompt "
                              f"({longest_prompt} tokens for {self.audio_chunks[-1]} chunks)")


# ---------------------------------------------------------------- graph modules

class AudioEncoderGraph(nn.Module):
    """(mel [n, n_mels, frames] f32) -> (audio_embeds [n * tokens_per_chunk, H])"""

    def __init__(self, model: VoxtralModel):
        super().__init__()
        self.model = model

    def forward(self, mel):
        return (self.model.encode_audio(mel),)


class ContextEncodingGraph(nn.Module):
    """(input_ids [1, P] i32, audio_embeds [A, H], audio_positions [A] i32, last_index [1] i32)
    -> (first_token [1] i32,)   writes KV for positions 0..P-1."""

    def __init__(self, model: VoxtralModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids, audio_embeds, audio_positions, last_index):
        x = self.model.embed_with_audio(input_ids, audio_embeds, audio_positions)
        t = x.shape[1]
        positions = torch.arange(t, dtype=I32)
        h, _ = self.model.language_model(x, positions, None, causal_visible(t))
        logits = self.model.lm_head(h.index_select(1, last_index.long()))
        return (torch.argmax(logits[0], dim=-1).to(I32),)


class TokenGenerationGraph(nn.Module):
    """(token [1, 1] i32, position [1] i32, cache_mask [1, S] i32) -> (next_token [1] i32,)"""

    def __init__(self, model: VoxtralModel, kv_len: int):
        super().__init__()
        self.model, self.kv_len = model, kv_len

    def forward(self, token, position, cache_mask):
        x = self.model.language_model.embed_tokens(token.long())
        h, _ = self.model.language_model(x, position, self.kv_len, cached_visible(position, cache_mask))
        return (torch.argmax(self.model.lm_head(h[0]), dim=-1).to(I32),)


@dataclass(frozen=True)
class GraphSpec:
    tag: str
    bucket: int


def graph_plan(buckets: Buckets) -> list[GraphSpec]:
    """Every (tag, bucket) a target needs."""
    plan = [GraphSpec("audio_encoder", n) for n in buckets.audio_chunks]
    plan += [GraphSpec("context_encoding", n) for n in buckets.audio_chunks]
    plan += [GraphSpec("token_generation", s) for s in buckets.kv_lengths]
    return plan


def build_graph(spec: GraphSpec, model: VoxtralModel) -> nn.Module:
    if spec.tag == "audio_encoder":
        return AudioEncoderGraph(model)
    if spec.tag == "context_encoding":
        return ContextEncodingGraph(model)
    if spec.tag == "token_generation":
        return TokenGenerationGraph(model, spec.bucket)
    raise ConfigError(f"unknown graph tag {spec.tag!r}")


def example_inputs(spec: GraphSpec, cfg: VoxtralConfig, buckets: Buckets, dtype=torch.float32) -> tuple:
    """One example tuple per (tag, bucket): the trace example and the routing key (shapes)."""
    a, h = cfg.audio, cfg.text.hidden_size
    if spec.tag == "audio_encoder":
        return (torch.zeros(spec.bucket, a.num_mel_bins, a.mel_frames_per_chunk, dtype=torch.float32),)
    if spec.tag == "context_encoding":
        n_audio = spec.bucket * a.tokens_per_chunk
        p = buckets.prompt_length(spec.bucket, cfg)
        return (torch.zeros(1, p, dtype=I32), torch.zeros(n_audio, h, dtype=dtype),
                torch.full((n_audio,), p, dtype=I32), torch.zeros(1, dtype=I32))
    if spec.tag == "token_generation":
        return (torch.zeros(1, 1, dtype=I32), torch.zeros(1, dtype=I32), torch.zeros(1, spec.bucket, dtype=I32))
    raise ConfigError(f"unknown graph tag {spec.tag!r}")
