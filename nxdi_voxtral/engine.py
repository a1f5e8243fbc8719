"""One rank's graphs: load the target (and draft) shards, build every (tag, bucket) graph module."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint import build_and_load, convert_hf_to_neuron_state_dict, read_safetensors
from .config import VoxtralConfig
from .drafts import check_layer_draft, load_dflash
from .errors import ConfigError
from .graphs import DRAFT_KINDS, Buckets, GraphSetup, build_graph, graph_plan
from .model import VoxtralModel
from .tp import SINGLE

DEFAULT_K = {"layers": 4, "ngram": 3}


@dataclass
class Engine:
    setup: GraphSetup
    model: VoxtralModel
    draft: object = None
    graphs: dict = field(default_factory=dict)

    def run(self, tag: str, bucket: int, *inputs):
        with torch.inference_mode():
            return self.graphs[(tag, bucket)](*inputs)


def load_voxtral(model_dir, sd: dict, cfg: VoxtralConfig, dtype, buckets: Buckets, tp=1, rank=0, comm=None):
    factory = lambda tp_, rank_, comm_: VoxtralModel(cfg, buckets.kv_lengths[-1], tp_, rank_, comm_ or SINGLE)  # noqa
    return build_and_load(factory, sd, dtype, str(model_dir), tp, rank, comm)


def same_tensors(a: dict, b: dict, prefixes: tuple[str, ...]) -> bool:
    keys = [k for k in a if k.startswith(prefixes)]
    return keys == [k for k in b if k.startswith(prefixes)] and all(
        a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in keys)


def check_request(draft, draft_kind, dtype):
    if dtype not in (torch.float32, torch.bfloat16):
        raise ConfigError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    if draft is not None and draft_kind is None:
        draft_kind = "layers"
    if draft_kind is not None and draft_kind not in DRAFT_KINDS:
        raise ConfigError(f"draft_kind must be one of {DRAFT_KINDS}, got {draft_kind!r}")
    if draft_kind in ("layers", "dflash") and draft is None:
        raise ConfigError(f"draft_kind={draft_kind!r} needs a draft checkpoint directory (draft=...)")
    return draft_kind


def build_engine(model_dir, draft=None, draft_kind=None, k=None, dtype=torch.float32, buckets=None, tp=1, rank=0,
                 comm=None) -> Engine:
    """Everything one rank holds. With tp > 1 every rank runs this with its own rank and communicator."""
    draft_kind = check_request(draft, draft_kind, dtype)
    buckets = buckets or Buckets()
    cfg = VoxtralConfig.from_dir(model_dir)
    buckets.validate(cfg)
    target_sd = convert_hf_to_neuron_state_dict(read_safetensors(model_dir))
    model = load_voxtral(model_dir, target_sd, cfg, dtype, buckets, tp, rank, comm)
    setup, draft_model = GraphSetup(cfg, buckets, dtype), None
    if draft_kind == "layers":
        k = DEFAULT_K["layers"] if k is None else k
        draft_cfg = VoxtralConfig.from_dir(draft)
        check_layer_draft(Path(draft), Path(model_dir), draft_cfg, cfg)
        draft_sd = convert_hf_to_neuron_state_dict(read_safetensors(draft))
        draft_model = load_voxtral(draft, draft_sd, draft_cfg, dtype, buckets, tp, rank, comm)
        # the public pruned draft copies these from the target: share them (one copy, one audio encoder run)
        lm_d, lm_t = draft_model.language_model, model.language_model
        if same_tensors(draft_sd, target_sd, ("language_model.embed_tokens.",)):
            lm_d.embed_tokens = lm_t.embed_tokens
        if same_tensors(draft_sd, target_sd, ("lm_head.",)):
            draft_model.lm_head = model.lm_head
        own_audio = not same_tensors(draft_sd, target_sd, ("audio_tower.", "multi_modal_projector."))
        if not own_audio:
            draft_model.audio_tower, draft_model.multi_modal_projector = model.audio_tower, model.multi_modal_projector
        setup = GraphSetup(cfg, buckets, dtype, "layers", k, draft_own_audio=own_audio)
    elif draft_kind == "dflash":
        dcfg, draft_model = load_dflash(draft, cfg, k, dtype, buckets.kv_lengths[-1], tp, rank, comm)
        k = dcfg.block_size - 1 if k is None else k
        setup = GraphSetup(cfg, buckets, dtype, "dflash", k, capture_layers=dcfg.target_layer_ids,
                           dflash_block=dcfg.block_size)
    elif draft_kind == "ngram":
        k = DEFAULT_K["ngram"] if k is None else k
        setup = GraphSetup(cfg, buckets, dtype, "ngram", k)
    if draft_kind is not None and (not isinstance(k, int) or k < 1):
        raise ConfigError(f"num_speculative_tokens must be a positive integer, got {k!r}")
    graphs = {(s.tag, s.bucket): build_graph(s, setup, model, draft_model) for s in graph_plan(setup)}
    return Engine(setup, model, draft_model, graphs)
