"""Model configuration read from a HF Voxtral `config.json` (transformers 4.5x and 5.x spellings)."""
from __future__ import annotations

import json
from dataclasses import dataclass, asdict
from pathlib import Path

from .errors import CheckpointError


@dataclass(frozen=True)
class AudioEncoderConfig:
    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_layers: int = 32
    num_heads: int = 20
    num_mel_bins: int = 128
    max_source_positions: int = 1500

    @property
    def stack_factor(self) -> int:
        # the projector consumes `intermediate_size` features: that many frames' worth of hidden states are stacked
        return self.intermediate_size // self.hidden_size

    @property
    def mel_frames_per_chunk(self) -> int:
        return 2 * self.max_source_positions  # conv2 has stride 2

    @property
    def tokens_per_chunk(self) -> int:
        return self.max_source_positions // self.stack_factor


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int = 131072
    hidden_size: int = 3072
    intermediate_size: int = 8192
    num_layers: int = 30
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    rope_theta: float = 1e8
    rms_norm_eps: float = 1e-5
    bos_token_id: int = 1
    eos_token_id: int = 2


@dataclass(frozen=True)
class VoxtralConfig:
    audio: AudioEncoderConfig = AudioEncoderConfig()
    text: TextConfig = TextConfig()
    audio_token_id: int = 24

    @classmethod
    def from_hf_dict(cls, d: dict) -> "VoxtralConfig":
        a, t = d.get("audio_config") or {}, d.get("text_config") or {}
        if not t:
            raise CheckpointError("config.json has no text_config: not a Voxtral checkpoint")
        rope = t.get("rope_parameters") or {}
        hidden = t.get("hidden_size", 3072)
        heads = t.get("num_attention_heads", 32)
        eos = t.get("eos_token_id", 2)
        audio = AudioEncoderConfig(
            hidden_size=a.get("hidden_size", a.get("d_model", 1280)),
            intermediate_size=a.get("intermediate_size", a.get("encoder_ffn_dim", 5120)),
            num_layers=a.get("num_hidden_layers", a.get("encoder_layers", 32)),
            num_heads=a.get("num_attention_heads", a.get("encoder_attention_heads", 20)),
            num_mel_bins=a.get("num_mel_bins", 128),
            max_source_positions=a.get("max_source_positions", 1500),
        )
        text = TextConfig(
            vocab_size=t.get("vocab_size", 131072),
            hidden_size=hidden,
            intermediate_size=t.get("intermediate_size", 8192),
            num_layers=t.get("num_hidden_layers", 30),
            num_heads=heads,
            num_kv_heads=t.get("num_key_value_heads", 8),
            head_dim=t.get("head_dim") or hidden // heads,
            rope_theta=float(rope.get("rope_theta", t.get("rope_theta", 1e8))),
            rms_norm_eps=t.get("rms_norm_eps", 1e-5),
            bos_token_id=t.get("bos_token_id", 1) or 1,
            eos_token_id=(eos[0] if isinstance(eos, list) else eos) if eos is not None else 2,
        )
        return cls(audio=audio, text=text, audio_token_id=d.get("audio_token_id", 24) or 24)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "VoxtralConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{model_dir}: no config.json (expected a Voxtral HF checkpoint directory)")
        try:
            return cls.from_hf_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from None

    def to_dict(self) -> dict:
        return asdict(self)
