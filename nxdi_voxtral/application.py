"""NxDVoxtralSpecDec: the user-facing application (load target and draft, generate, transcribe)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import generate as gen
from .checkpoint import build_and_load, convert_hf_to_neuron_state_dict, read_safetensors
from .config import VoxtralConfig
from .contract import ContractViolation, check_distinct_signatures, signature
from .drafts import check_layer_draft, load_dflash, share_equal_modules
from .errors import CheckpointError, ConfigError
from .graphs import DRAFT_KINDS, Buckets, GraphSetup, build_graph, example_inputs, graph_plan
from .model import VoxtralModel
from .tp import SINGLE
from .processing import build_prompt, decode, load_audio, load_tokenizer
from .speculative import DFlashDrafter, LayerDrafter, NgramDrafter, SpecStats

log = logging.getLogger(__name__)
DEFAULT_K = {"layers": 4, "ngram": 3}


@dataclass
class Transcription:
    text: str
    token_ids: list[int]
    timings: dict = field(default_factory=dict)
    stats: SpecStats | None = None


def load_model(model_dir: str | Path, dtype: torch.dtype, buckets: Buckets, tp: int = 1, rank: int = 0,
               comm=None) -> tuple[VoxtralConfig, VoxtralModel]:
    cfg = VoxtralConfig.from_dir(model_dir)
    buckets.validate(cfg)
    sd = convert_hf_to_neuron_state_dict(read_safetensors(model_dir))
    factory = lambda tp_, rank_, comm_: VoxtralModel(cfg, buckets.kv_lengths[-1], tp_, rank_, comm_ or SINGLE)  # noqa
    return cfg, build_and_load(factory, sd, dtype, str(model_dir), tp, rank, comm)


class NxDVoxtralSpecDec:
    """Voxtral transcription over fixed-shape graphs, optionally with a draft. Graphs run eagerly on CPU."""

    def __init__(self, cfg: VoxtralConfig, model: VoxtralModel, tokenizer, setup: GraphSetup, draft=None,
                 model_dir=None):
        self.cfg, self.model, self.tokenizer, self.setup, self.draft = cfg, model, tokenizer, setup, draft
        self.buckets, self.model_dir = setup.buckets, model_dir
        plan = graph_plan(setup)
        self.graphs = {(s.tag, s.bucket): build_graph(s, setup, model, draft) for s in plan}
        self.signatures = {(s.tag, s.bucket): signature(example_inputs(s, setup)) for s in plan}
        check_distinct_signatures(self.signatures)

    @classmethod
    def from_pretrained(cls, model_dir, draft=None, draft_kind: str | None = None,
                        num_speculative_tokens: int | None = None, dtype: torch.dtype = torch.float32,
                        buckets: Buckets | None = None):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ConfigError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
        if draft is not None and draft_kind is None:
            draft_kind = "layers"
        if draft_kind is not None and draft_kind not in DRAFT_KINDS:
            raise ConfigError(f"draft_kind must be one of {DRAFT_KINDS}, got {draft_kind!r}")
        if draft_kind in ("layers", "dflash") and draft is None:
            raise ConfigError(f"draft_kind={draft_kind!r} needs a draft checkpoint directory (draft=...)")
        buckets = buckets or Buckets()
        cfg, model = load_model(model_dir, dtype, buckets)
        tokenizer = load_tokenizer(model_dir)
        n_words = tokenizer.instruct_tokenizer.tokenizer.n_words
        if n_words > cfg.text.vocab_size:
            raise CheckpointError(f"{model_dir}: tokenizer has {n_words} tokens but the model's vocabulary is "
                                  f"{cfg.text.vocab_size}")
        k = num_speculative_tokens
        setup = GraphSetup(cfg, buckets, dtype)
        draft_model = None
        if draft_kind == "layers":
            k = DEFAULT_K["layers"] if k is None else k
            draft_cfg = VoxtralConfig.from_dir(draft)
            check_layer_draft(Path(draft), Path(model_dir), draft_cfg, cfg)
            _, draft_model = load_model(draft, dtype, buckets)
            own_audio = share_equal_modules(draft_model, model)
            setup = GraphSetup(cfg, buckets, dtype, "layers", k, draft_own_audio=own_audio)
        elif draft_kind == "dflash":
            dcfg, draft_model = load_dflash(draft, cfg, k or 1, dtype, buckets.kv_lengths[-1])
            k = dcfg.block_size - 1 if k is None else k
            setup = GraphSetup(cfg, buckets, dtype, "dflash", k, capture_layers=dcfg.target_layer_ids,
                               dflash_block=dcfg.block_size)
        elif draft_kind == "ngram":
            k = DEFAULT_K["ngram"] if k is None else k
            setup = GraphSetup(cfg, buckets, dtype, "ngram", k)
        if draft_kind is not None and (not isinstance(k, int) or k < 1):
            raise ConfigError(f"num_speculative_tokens must be a positive integer, got {k!r}")
        return cls(cfg, model, tokenizer, setup, draft_model, model_dir)

    @property
    def draft_kind(self) -> str | None:
        return self.setup.draft_kind

    def run(self, tag: str, bucket: int, *inputs):
        """Call one graph. Inputs must have exactly the declared shapes: what a compiled graph would accept."""
        if signature(inputs) != self.signatures[(tag, bucket)]:
            raise ContractViolation(f"{tag}[{bucket}] called with shapes {signature(inputs)}, "
                                    f"compiled for {self.signatures[(tag, bucket)]}")
        with torch.inference_mode():
            return self.graphs[(tag, bucket)](*inputs)

    def generate(self, input_ids: torch.Tensor, input_features: torch.Tensor, max_new_tokens: int = 128,
                 timings: dict | None = None, return_stats: bool = False):
        """Greedy continuation of input_ids -> LongTensor [1, n_new] (EOS included when reached); with a draft the
        tokens are the same, fewer target passes. return_stats=True -> (ids, SpecStats)."""
        s = self.setup
        gen.check_capacity(input_ids.shape[-1], max_new_tokens + s.k + s.dflash_block, self.buckets)
        stats = SpecStats(s.draft_kind or "none", s.k)
        t0 = time.perf_counter()
        first, position, drafter = self.prefill(input_ids, input_features, stats)
        t1 = time.perf_counter()
        eos = self.cfg.text.eos_token_id
        if drafter is None:
            tokens = gen.decode(self.run, first, position, max_new_tokens, eos, self.buckets)
            stats.target_passes += len(tokens) - 1
        else:
            tokens = gen.speculate(self.run, drafter, first, position, max_new_tokens, eos, self.buckets, s.k, stats)
        t2 = time.perf_counter()
        stats.generated = len(tokens)
        if timings is not None:
            timings.update(prefill_s=t1 - t0, decode_s=t2 - t1, new_tokens=len(tokens),
                           decode_tokens_per_s=(len(tokens) - 1) / (t2 - t1) if len(tokens) > 1 else 0.0)
        ids_out = torch.tensor([tokens], dtype=torch.long)
        return (ids_out, stats) if return_stats else ids_out

    def prefill(self, input_ids: torch.Tensor, input_features: torch.Tensor, stats: SpecStats):
        """Audio encoder + target prefill + the draft's own prefill -> (first token, its position, drafter)."""
        s = self.setup
        nb, mel, ids, audio_positions, last_index = gen.prepare_prefill(input_ids, input_features, self.cfg,
                                                                        self.buckets)
        (audio_embeds,) = self.run("audio_encoder", nb, mel)
        first, *prompt_features = self.run("context_encoding", nb, ids, audio_embeds, audio_positions, last_index)
        position = int(last_index[0]) + 1
        drafter = None
        if s.draft_kind == "layers":
            drafter = LayerDrafter(self.run, self.buckets, s.k, stats, int(ids[0, position - 1]))
            drafter.prefill(nb, ids, mel if s.draft_own_audio else audio_embeds, audio_positions)
        elif s.draft_kind == "dflash":
            drafter = DFlashDrafter(self.run, self.buckets, s.k, s.dflash_block, s.feature_dim, s.dtype, stats)
            drafter.prefill(nb, prompt_features[0])
        elif s.draft_kind == "ngram":
            drafter = NgramDrafter(s.k)
        return int(first[0]), position, drafter

    def prepare(self, audio, language: str | None = None, sampling_rate: int | None = None):
        samples = load_audio(audio, sampling_rate)
        a = self.cfg.audio
        prompt = build_prompt(self.tokenizer, samples, language, a.num_mel_bins, a.mel_frames_per_chunk)
        self.buckets.chunk_bucket(prompt.input_features.shape[0], self.cfg)  # too long -> AudioTooLongError now
        return prompt

    def transcribe(self, audio, language: str | None = None, sampling_rate: int | None = None,
                   max_new_tokens: int = 256) -> Transcription:
        t0 = time.perf_counter()
        prompt = self.prepare(audio, language, sampling_rate)
        timings = {"features_s": time.perf_counter() - t0, "audio_s": prompt.duration_s}
        ids, stats = self.generate(prompt.input_ids, prompt.input_features, max_new_tokens, timings, True)
        timings["total_s"] = time.perf_counter() - t0
        ids = ids[0].tolist()
        return Transcription(text=decode(self.tokenizer, ids), token_ids=ids, timings=timings, stats=stats)
