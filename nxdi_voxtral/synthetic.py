"""Random Voxtral checkpoints in the real on-disk format (HF config.json + safetensors + tekken.json).

Used by the embedded demo, the tests and the benchmarks. Same arguments and seed -> same bytes.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, replace
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config import AudioEncoderConfig, TextConfig, VoxtralConfig

# Voxtral's special tokens (Tekken v7 ids); the rest of the first 1000 ids are fillers
SPECIAL_TOKENS = {0: "<unk>", 1: "<s>", 2: "</s>", 3: "[INST]", 4: "[/INST]", 5: "[AVAILABLE_TOOLS]",
                  6: "[/AVAILABLE_TOOLS]", 7: "[TOOL_RESULTS]", 8: "[/TOOL_RESULTS]", 9: "[TOOL_CALLS]",
                  10: "[IMG]", 11: "<pad>", 12: "[IMG_BREAK]", 13: "[IMG_END]", 14: "[PREFIX]", 15: "[MIDDLE]",
                  16: "[SUFFIX]", 17: "[SYSTEM_PROMPT]", 18: "[/SYSTEM_PROMPT]", 19: "[TOOL_CONTENT]",
                  24: "[AUDIO]", 25: "[BEGIN_AUDIO]", 32: "[ARGS]", 33: "[CALL_ID]", 34: "[TRANSCRIBE]"}
NUM_SPECIAL = 1000

TINY_AUDIO = AudioEncoderConfig(hidden_size=32, intermediate_size=128, num_layers=1, num_heads=2)
TINY_TEXT = TextConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=32)
DEMO_SEED = 1234


def write_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A real Tekken tokenizer with Voxtral's audio settings, from the vocabulary file mistral-common ships."""
    src = json.loads((resources.files("mistral_common") / "data" / "tekken_240911.json").read_text())
    src.pop("image", None)
    src["config"].update(version="v7", default_vocab_size=vocab_size, default_num_special_tokens=NUM_SPECIAL)
    src["special_tokens"] = [{"rank": i, "token_str": SPECIAL_TOKENS.get(i, f"<SPECIAL_{i}>"), "is_control": True}
                             for i in range(NUM_SPECIAL)]
    src["audio"] = {"sampling_rate": 16000, "frame_rate": 12.5, "chunk_length_s": 30.0,
                    "audio_encoding_config": {"num_mel_bins": 128, "hop_length": 160, "window_size": 400}}
    (out_dir / "tekken.json").write_text(json.dumps(src))


def hf_config_dict(cfg: VoxtralConfig) -> dict:
    a, t = cfg.audio, cfg.text
    return {
        "architectures": ["VoxtralForConditionalGeneration"], "model_type": "voxtral",
        "audio_token_id": cfg.audio_token_id, "projector_hidden_act": "gelu", "hidden_size": t.hidden_size,
        "audio_config": {"model_type": "voxtral_encoder", "hidden_size": a.hidden_size,
                         "intermediate_size": a.intermediate_size, "num_hidden_layers": a.num_layers,
                         "num_attention_heads": a.num_heads, "num_mel_bins": a.num_mel_bins,
                         "max_source_positions": a.max_source_positions, "activation_function": "gelu",
                         "scale_embedding": False},
        "text_config": {"model_type": "llama", "vocab_size": t.vocab_size, "hidden_size": t.hidden_size,
                        "intermediate_size": t.intermediate_size, "num_hidden_layers": t.num_layers,
                        "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads,
                        "head_dim": t.head_dim, "rms_norm_eps": t.rms_norm_eps, "hidden_act": "silu",
                        "rope_theta": t.rope_theta, "max_position_embeddings": 131072,
                        "bos_token_id": t.bos_token_id, "eos_token_id": t.eos_token_id,
                        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False},
    }


def random_state_dict(cfg: VoxtralConfig, seed: int, std: float = 0.3, audio_std: float = 0.05) -> dict:
    """HF (hub / transformers 4.5x) key layout. std of the decoder weights controls how varied greedy output is."""
    from .model import VoxtralModel
    g = torch.Generator().manual_seed(seed)
    model = VoxtralModel(cfg, max_len=1)
    sd = {}
    for k, p in model.state_dict().items():
        if k.startswith("language_model") and k.endswith("norm.weight"):
            v = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        elif "layer_norm" in k:
            v = (1.0 if k.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=g)
        else:
            v = torch.randn(p.shape, generator=g) * (audio_std if k.startswith("audio_tower") else std)
        sd[k] = v.contiguous()
    out = {}
    for k, v in sd.items():
        if k.startswith("language_model."):
            k = "language_model.model." + k[len("language_model."):]
        elif k.startswith("lm_head."):
            k = "language_model." + k
        out[k] = v
    return out


def write_checkpoint(out_dir: str | Path, cfg: VoxtralConfig, state_dict: dict, shards: int = 1) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg), indent=2))
    write_tokenizer(out, cfg.text.vocab_size)
    keys = sorted(state_dict)
    if shards == 1:
        save_file({k: state_dict[k] for k in keys}, str(out / "model.safetensors"))
        return out
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        save_file({k: state_dict[k] for k in part}, str(out / name))
        weight_map.update({k: name for k in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def write_random_checkpoint(out_dir, cfg: VoxtralConfig | None = None, seed: int = 0, std: float = 0.3,
                            shards: int = 1) -> Path:
    cfg = cfg or VoxtralConfig(audio=TINY_AUDIO, text=TINY_TEXT)
    return write_checkpoint(out_dir, cfg, random_state_dict(cfg, seed, std), shards)


def demo_dirs() -> dict[str, Path]:
    """The embedded demo: a tiny random target (its layer 1 damped, so the 1-layer draft agrees often), its
    pruned-layer draft and a random DFlash draft. Built once per machine into the user cache (atomic rename)."""
    root = Path(os.environ.get("NXDI_VOXTRAL_CACHE", Path.home() / ".cache" / "nxdi_voxtral"))
    cfg = VoxtralConfig(audio=TINY_AUDIO, text=TINY_TEXT)
    digest = hashlib.sha256(json.dumps(asdict(cfg), sort_keys=True).encode()).hexdigest()[:12]
    final = root / f"demo-v2-seed{DEMO_SEED}-{digest}"
    if not (final / "target" / "config.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".building-"))
        sd = damp_dropped_layers(random_state_dict(cfg, DEMO_SEED), [0], 0.05)
        write_checkpoint(tmp / "target", cfg, sd)
        write_layer_draft(tmp / "target", tmp / "layers", [0])
        write_random_dflash(tmp / "dflash", cfg, target_layer_ids=(0, 1), num_layers=1, seed=DEMO_SEED)
        try:
            tmp.rename(final)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    return {"target": final / "target", "layers": final / "layers", "dflash": final / "dflash"}


def layer_draft_state_dict(target_sd: dict, keep_layers: list[int]) -> dict:
    """The pruned-layer draft: the target's layers `keep_layers` renumbered 0..n-1, everything else shared."""
    prefix = "language_model.model.layers."
    out = {k: v for k, v in target_sd.items() if not k.startswith(prefix)}
    for new, old in enumerate(keep_layers):
        src = f"{prefix}{old}."
        out.update({f"{prefix}{new}." + k[len(src):]: v for k, v in target_sd.items() if k.startswith(src)})
    return out


def damp_dropped_layers(target_sd: dict, keep_layers: list[int], factor: float) -> dict:
    """Scale o_proj / down_proj of the layers a pruned draft drops: the smaller `factor`, the closer the draft
    tracks the target (controllable acceptance)."""
    n = 1 + max(int(k.split(".")[3]) for k in target_sd if k.startswith("language_model.model.layers."))
    out = dict(target_sd)
    for i in set(range(n)) - set(keep_layers):
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            key = f"language_model.model.layers.{i}.{name}.weight"
            out[key] = target_sd[key] * factor
    return out


def write_layer_draft(target_dir: str | Path, out_dir: str | Path, keep_layers: list[int]) -> Path:
    from .checkpoint import read_safetensors
    from .config import VoxtralConfig as _Cfg
    cfg = _Cfg.from_dir(target_dir)
    draft_cfg = replace(cfg, text=replace(cfg.text, num_layers=len(keep_layers)))
    out = write_checkpoint(out_dir, draft_cfg, layer_draft_state_dict(read_safetensors(target_dir), keep_layers))
    shutil.copy(Path(target_dir) / "tekken.json", out / "tekken.json")
    return out


def write_random_dflash(out_dir: str | Path, target: VoxtralConfig, target_layer_ids=(0, 1), num_layers: int = 2,
                        block_size: int = 16, mask_token_id: int = 20, seed: int = 0, std: float = 0.3,
                        num_heads: int | None = None, num_kv_heads: int | None = None,
                        head_dim: int | None = None) -> Path:
    """A DFlash draft checkpoint in the public format (config.json + model.safetensors, no embeddings/LM head)."""
    from .dflash import DFlashConfig, DFlashDraft
    t = target.text
    text = TextConfig(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                      num_layers=num_layers, num_heads=num_heads or t.num_heads,
                      num_kv_heads=num_kv_heads or t.num_kv_heads, head_dim=head_dim or t.head_dim,
                      rope_theta=t.rope_theta, rms_norm_eps=t.rms_norm_eps)
    cfg = DFlashConfig(block_size=block_size, target_layer_ids=tuple(target_layer_ids), mask_token_id=mask_token_id,
                       num_target_layers=t.num_layers, text=text)
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k, p in DFlashDraft(cfg, max_len=1).state_dict().items():
        base = 1.0 if k.endswith("norm.weight") else 0.0
        sd[k] = (base + (0.1 if base else std) * torch.randn(p.shape, generator=g)).contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": block_size,
        "num_hidden_layers": num_layers, "num_target_layers": t.num_layers, "hidden_size": text.hidden_size,
        "intermediate_size": text.intermediate_size, "num_attention_heads": text.num_heads,
        "num_key_value_heads": text.num_kv_heads, "head_dim": text.head_dim, "rms_norm_eps": text.rms_norm_eps,
        "rope_theta": text.rope_theta, "vocab_size": t.vocab_size, "attention_bias": False,
        "layer_types": ["full_attention"] * num_layers,
        "dflash_config": {"target_layer_ids": list(target_layer_ids), "mask_token_id": mask_token_id}}, indent=2))
    save_file(sd, str(out / "model.safetensors"))
    return out
