"""Loading the drafts and checking that they fit the target."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .checkpoint import StateDict, build_and_load, read_safetensors, release_file_pages, sha256_file
from .config import VoxtralConfig
from .dflash import DFlashConfig, DFlashDraft
from .errors import CheckpointError, ConfigError, DraftMismatchError


# what the public pruned draft copies from the target, by checkpoint prefix
SHAREABLE = {"embed_tokens": ("language_model.embed_tokens.",), "lm_head": ("lm_head.",),
             "audio": ("audio_tower.", "multi_modal_projector.")}


def share_with_target(draft, target, parts) -> None:
    """One copy of what the draft shares with the target (and one audio encoder run)."""
    if "embed_tokens" in parts:
        draft.language_model.embed_tokens = target.language_model.embed_tokens
    if "lm_head" in parts:
        draft.lm_head = target.lm_head
    if "audio" in parts:
        draft.audio_tower, draft.multi_modal_projector = target.audio_tower, target.multi_modal_projector


def same_tensors(a: dict, b: dict, prefixes: tuple[str, ...]) -> bool:
    """Whether a's tensors under prefixes equal b's; each of a's is dropped from memory once compared (a draft's
    copy of the target's LM head is read once, tensor by tensor, and never held)."""
    keys = [k for k in a if k.startswith(prefixes)]
    if keys != [k for k in b if k.startswith(prefixes)]:
        return False
    for k in keys:
        equal = a[k].shape == b[k].shape and torch.equal(a[k], b[k])
        release_file_pages(a[k])
        if not equal:
            return False
    return True


def check_layer_draft(draft_dir: Path, target_dir: Path, draft: VoxtralConfig, target: VoxtralConfig) -> None:
    for what, d, t in (("vocabulary size", draft.text.vocab_size, target.text.vocab_size),
                       ("hidden size", draft.text.hidden_size, target.text.hidden_size),
                       ("audio token id", draft.audio_token_id, target.audio_token_id)):
        if d != t:
            raise DraftMismatchError(f"layer draft {draft_dir}: {what} {d} != target's {t}")
    dt, tt = Path(draft_dir) / "tekken.json", Path(target_dir) / "tekken.json"
    if dt.is_file() and tt.is_file() and sha256_file(dt) != sha256_file(tt):
        raise DraftMismatchError(f"layer draft {draft_dir}: tekken.json differs from the target's tokenizer")
    layer_types = json.loads((Path(draft_dir) / "config.json").read_text())["text_config"].get("layer_types")
    if layer_types is not None and len(layer_types) not in (draft.text.num_layers, target.text.num_layers):
        raise CheckpointError(f"layer draft {draft_dir}: layer_types has {len(layer_types)} entries for "
                              f"{draft.text.num_layers} layers")


def load_dflash(draft_dir: str | Path, target: VoxtralConfig, k: int, dtype: torch.dtype, buckets, tp: int = 1,
                rank: int = 0, comm=None):
    cfg = DFlashConfig.from_dir(draft_dir)
    cfg.check_against(target.text, cfg.block_size - 1 if k is None else k)
    raw = json.loads((Path(draft_dir) / "config.json").read_text())
    if "sliding_attention" in (raw.get("layer_types") or []):
        raise ConfigError(f"DFlash draft {draft_dir}: sliding-window layers are not supported")
    if raw.get("attention_bias"):
        raise ConfigError(f"DFlash draft {draft_dir}: attention_bias=true is not supported")
    factory = lambda comm_: DFlashDraft(cfg, buckets.kv_lengths[-1], comm_, buckets.max_batch)  # noqa: E731
    return cfg, build_and_load(factory, read_dflash_state_dict(draft_dir), dtype, str(draft_dir), tp, rank, comm)


def read_dflash_state_dict(draft_dir: str | Path) -> StateDict:
    """A DFlash checkpoint under DFlashDraft's names (a leading `model.` dropped), remembering the file's keys."""
    raw_sd = read_safetensors(draft_dir)
    ours = {k: (k[len("model."):] if k.startswith("model.") else k) for k in raw_sd}
    return StateDict({ours[k]: v for k, v in raw_sd.items()}, source_keys={v: k for k, v in ours.items()})
