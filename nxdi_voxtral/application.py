"""NxDVoxtralSpecDec: the user-facing application (load, generate, transcribe)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import generate as gen
from .checkpoint import check_and_cast, convert_hf_to_neuron_state_dict, read_safetensors
from .config import VoxtralConfig
from .errors import CheckpointError, ConfigError
from .contract import ContractViolation, check_distinct_signatures, signature
from .graphs import Buckets, build_graph, example_inputs, graph_plan
from .model import VoxtralModel
from .processing import build_prompt, decode, load_audio, load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class Transcription:
    text: str
    token_ids: list[int]
    timings: dict = field(default_factory=dict)
    stats: object = None


def load_model(model_dir: str | Path, dtype: torch.dtype, buckets: Buckets) -> tuple[VoxtralConfig, VoxtralModel]:
    cfg = VoxtralConfig.from_dir(model_dir)
    buckets.validate(cfg)
    with torch.device("meta"):
        model = VoxtralModel(cfg, max_len=buckets.kv_lengths[-1])
    sd = check_and_cast(convert_hf_to_neuron_state_dict(read_safetensors(model_dir)), model, dtype, str(model_dir))
    model = model.to_empty(device="cpu").to(dtype)
    model.load_state_dict(sd, strict=False)  # strict on weights via check_and_cast; caches / rope are state
    model.language_model.init_state()
    return cfg, model.eval()


class NxDVoxtralSpecDec:
    """Voxtral transcription over fixed-shape graphs. Graphs run eagerly on CPU (the `cpu` backend)."""

    def __init__(self, cfg: VoxtralConfig, model: VoxtralModel, tokenizer, buckets: Buckets, model_dir=None):
        self.cfg, self.model, self.tokenizer, self.buckets = cfg, model, tokenizer, buckets
        self.model_dir = model_dir
        plan = graph_plan(buckets)
        self.graphs = {(s.tag, s.bucket): build_graph(s, model) for s in plan}
        dtype = model.lm_head.weight.dtype
        self.signatures = {(s.tag, s.bucket): signature(example_inputs(s, cfg, buckets, dtype)) for s in plan}
        check_distinct_signatures(self.signatures)

    @classmethod
    def from_pretrained(cls, model_dir, dtype: torch.dtype = torch.float32, buckets: Buckets | None = None):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ConfigError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
        buckets = buckets or Buckets()
        cfg, model = load_model(model_dir, dtype, buckets)
        tokenizer = load_tokenizer(model_dir)
        n_words = tokenizer.instruct_tokenizer.tokenizer.n_words
        if n_words > cfg.text.vocab_size:
            raise CheckpointError(f"{model_dir}: tokenizer has {n_words} tokens but the model's vocabulary is "
                                  f"{cfg.text.vocab_size}")
        return cls(cfg, model, tokenizer, buckets, model_dir)

    def run(self, tag: str, bucket: int, *inputs):
        """Call one graph. Inputs must have exactly the declared shapes: what a compiled graph would accept."""
        if signature(inputs) != self.signatures[(tag, bucket)]:
            raise ContractViolation(f"{tag}[{bucket}] called with shapes {signature(inputs)}, "
                                    f"compiled for {self.signatures[(tag, bucket)]}")
        with torch.inference_mode():
            return self.graphs[(tag, bucket)](*inputs)

    def generate(self, input_ids: torch.Tensor, input_features: torch.Tensor, max_new_tokens: int = 128,
                 timings: dict | None = None) -> torch.Tensor:
        """Greedy continuation of input_ids -> LongTensor [1, n_new]; stops after EOS (included)."""
        gen.check_capacity(input_ids.shape[-1], max_new_tokens, self.buckets)
        t0 = time.perf_counter()
        first, pos = gen.prefill(self.run, input_ids, input_features, self.cfg, self.buckets)
        t1 = time.perf_counter()
        tokens = gen.decode(self.run, first, pos, max_new_tokens, self.cfg.text.eos_token_id, self.buckets)
        t2 = time.perf_counter()
        if timings is not None:
            timings.update(prefill_s=t1 - t0, decode_s=t2 - t1, new_tokens=len(tokens),
                           decode_tokens_per_s=(len(tokens) - 1) / (t2 - t1) if len(tokens) > 1 else 0.0)
        return torch.tensor([tokens], dtype=torch.long)

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
        ids = self.generate(prompt.input_ids, prompt.input_features, max_new_tokens, timings)[0].tolist()
        timings["total_s"] = time.perf_counter() - t0
        return Transcription(text=decode(self.tokenizer, ids), token_ids=ids, timings=timings)
