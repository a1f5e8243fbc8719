"""Model configuration read from a HF Voxtral `config.json` (transformers 4.5x and 5.x spellings)."""
from __future__ import annotations

import json
from dataclasses import dataclass, asdict
from pathlib import Path

from .errors import CheckpointError

SAMPLE_RATE = 16000         # the audio tower's input rate
N_FFT, HOP = 400, 160       # its log-mel frames: 25 ms windows every 10 ms (100 frames per second)


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
    def from_hf_dict(cls, d: dict, source: str = "config.json") -> "VoxtralConfig":
        """Raises CheckpointError naming `source` and the field for a config that is not a Voxtral one or has a
        field of the wrong type."""
        if not isinstance(d, dict):
            raise CheckpointError(f"{source}: expected a JSON object, got {type(d).__name__}")
        a, t = _section(d, "audio_config", source), _section(d, "text_config", source)
        if not t:
            hint = " (it is a DFlash draft config: use draft_kind='dflash')" if "dflash_config" in d else ""
            raise CheckpointError(f"{source}: no text_config: not a Voxtral checkpoint{hint}")
        A = lambda keys, default: _field(a, "audio_config", keys, default, source)  # noqa: E731
        T = lambda keys, default, kind=int: _field(t, "text_config", keys, default, source, kind)  # noqa: E731
        rope = _section(t, "rope_parameters", source, "text_config.")
        hidden = T("hidden_size", 3072)
        heads = T("num_attention_heads", 32)
        eos = t.get("eos_token_id", 2)
        if isinstance(eos, list) and eos:
            eos = eos[0]
        if eos is not None and not _is_int(eos):
            raise CheckpointError(f"{source}: text_config.eos_token_id must be an integer or a list of integers, "
                                  f"got {eos!r}")
        audio = AudioEncoderConfig(
            hidden_size=A(("hidden_size", "d_model"), 1280),
            intermediate_size=A(("intermediate_size", "encoder_ffn_dim"), 5120),
            num_layers=A(("num_hidden_layers", "encoder_layers"), 32),
            num_heads=A(("num_attention_heads", "encoder_attention_heads"), 20),
            num_mel_bins=A("num_mel_bins", 128),
            max_source_positions=A("max_source_positions", 1500),
        )
        text = TextConfig(
            vocab_size=T("vocab_size", 131072),
            hidden_size=hidden,
            intermediate_size=T("intermediate_size", 8192),
            num_layers=T("num_hidden_layers", 30),
            num_heads=heads,
            num_kv_heads=T("num_key_value_heads", 8),
            head_dim=T("head_dim", hidden // heads),
            rope_theta=float(_field(rope, "text_config.rope_parameters", "rope_theta",
                                    T("rope_theta", 1e8, float), source, float)),
            rms_norm_eps=T("rms_norm_eps", 1e-5, float),
            bos_token_id=_field(t, "text_config", "bos_token_id", 1, source, int, positive=False) or 1,
            eos_token_id=2 if eos is None else eos,
        )
        audio_token_id = _field(d, "", "audio_token_id", 24, source, int, positive=False) or 24
        return cls(audio=audio, text=text, audio_token_id=audio_token_id)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "VoxtralConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{model_dir}: no config.json (expected a Voxtral HF checkpoint directory)")
        try:
            return cls.from_hf_dict(json.loads(path.read_text()), source=str(path))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from None

    def to_dict(self) -> dict:
        return asdict(self)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _section(d: dict, key: str, source: str, prefix: str = "") -> dict:
    v = d.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise CheckpointError(f"{source}: {prefix}{key} must be an object, got {type(v).__name__}")
    return v


def _field(section: dict, where: str, keys, default, source: str, kind=int, positive: bool = True):
    """section[key] for the first of `keys` present and not null (else default), checked to be `kind`."""
    for key in (keys,) if isinstance(keys, str) else keys:
        v = section.get(key)
        if v is None:
            continue
        name = f"{where}.{key}" if where else key
        ok = _is_int(v) if kind is int else (_is_int(v) or isinstance(v, float))
        if not ok:
            raise CheckpointError(f"{source}: {name} must be {'an integer' if kind is int else 'a number'}, "
                                  f"got {type(v).__name__} {v!r}")
        if positive and not v > 0:
            raise CheckpointError(f"{source}: {name} must be positive, got {v!r}")
        return v
    return default
