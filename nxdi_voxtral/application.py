"""NxDVoxtralSpecDec: the user-facing application (load target and draft, generate, transcribe)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import backends, generate as gen
from .config import VoxtralConfig
from .contract import ContractViolation, check_distinct_signatures, signature
from .backends import EAGER, Backend
from .engine import Engine, check_request
from .errors import CheckpointError, ConfigError, ModelClosedError
from .graphs import Buckets, GraphSetup, example_inputs, graph_plan
from .tp import layout
from .processing import build_prompt, decode, load_audio, load_tokenizer
from .speculative import DFlashDrafter, LayerDrafter, NgramDrafter, SpecStats


@dataclass
class Transcription:
    text: str
    token_ids: list[int]
    timings: dict = field(default_factory=dict)
    stats: SpecStats | None = None


class NxDVoxtralSpecDec:
    """Voxtral transcription over fixed-shape graphs, optionally with a draft and tensor parallelism.

    One object owns every (tag, bucket) graph (NxDI's application): `from_pretrained` loads a checkpoint,
    `compile(path)` writes a release of it for a backend, `from_artifacts(path)` loads one. The host loop (prefill,
    decode, speculation) runs here; graphs run on `self.ranks` (ranks.py: this process at tp 1, rank worker
    processes at tp > 1), through the same `run(tag, bucket, *inputs)`."""

    def __init__(self, tokenizer, ranks, backend: Backend = EAGER, model_dir=None, build_kwargs: dict | None = None,
                 compile_stats: list[dict] | None = None):
        self.tokenizer, self.ranks, self.backend, self.model_dir = tokenizer, ranks, backend, model_dir
        self.setup = ranks.setup
        self.cfg, self.buckets = self.setup.cfg, self.setup.buckets
        self.build_kwargs = build_kwargs
        self.compile_stats = compile_stats  # torch.compile backends: per graph seconds / cache hits (rank 0)
        self.closed = False
        self.signatures = {(s.tag, s.bucket): signature(example_inputs(s, self.setup)) for s in graph_plan(self.setup)}
        check_distinct_signatures(self.signatures)

    @property
    def engine(self) -> Engine | None:
        """The in-process rank's Engine (tp 1 on CPU), else None."""
        return getattr(self.ranks, "engine", None)

    @property
    def model(self):
        return self.engine.model if self.engine else None

    @property
    def draft(self):
        return self.engine.draft if self.engine else None

    @classmethod
    def from_pretrained(cls, model_dir, draft=None, draft_kind: str | None = None,
                        num_speculative_tokens: int | None = None, dtype: torch.dtype = torch.float32,
                        buckets: Buckets | None = None, tp_degree: int = 1, call_timeout_s: float | None = None,
                        backend: str = "eager"):
        """call_timeout_s (tp_degree > 1): limit of one graph call before a silent rank is reported (WorkerError);
        default NXDI_VOXTRAL_CALL_TIMEOUT_S or 600 s, 0 for none.
        backend: a name from nxdi_voxtral.backends (eager, inductor, ...) whose graphs can be prepared from a
        checkpoint at load; the torch.compile backends compile every graph here and fill `compile_stats`."""
        be = backends.get(backend)
        build_kwargs, tokenizer = cls.check_pretrained(model_dir, draft, draft_kind, num_speculative_tokens, dtype,
                                                       buckets, tp_degree)
        ranks, stats = be.open(build_kwargs, tp_degree, call_timeout_s)
        return cls(tokenizer, ranks, be, model_dir, build_kwargs, stats)

    @staticmethod
    def check_pretrained(model_dir, draft, draft_kind, k, dtype, buckets, tp_degree):
        """Everything cheap, before any weight is read or a rank process starts -> (build_engine kwargs, tokenizer)."""
        draft_kind = check_request(draft, draft_kind, dtype)
        if draft is not None and draft_kind == "ngram":
            raise ConfigError(f"draft_kind='ngram' uses no draft checkpoint, but draft={str(draft)!r} was given")
        cfg = VoxtralConfig.from_dir(model_dir)
        tokenizer = load_tokenizer(model_dir)
        n_words = tokenizer.instruct_tokenizer.tokenizer.n_words
        if n_words > cfg.text.vocab_size:
            raise CheckpointError(f"{model_dir}: tokenizer has {n_words} tokens but the model's vocabulary is "
                                  f"{cfg.text.vocab_size}")
        if not isinstance(tp_degree, int) or isinstance(tp_degree, bool) or tp_degree < 1:
            raise ConfigError(f"tp_degree must be a positive integer, got {tp_degree!r}")
        layout(cfg.text, cfg.audio, tp_degree, 0)  # tp that does not divide the heads: fail before spawning
        return dict(model_dir=model_dir, draft=draft, draft_kind=draft_kind, k=k, dtype=dtype,
                    buckets=buckets or Buckets()), tokenizer

    def compile(self, out, backend: str | None = None, pack_weights: bool = False, progress=print) -> dict:
        """Build a release of this model's checkpoint, graphs and buckets for `backend` (default: the first one
        available here of torchneuron, nxd, export) into the new directory `out` -> its manifest. The build loads
        its own copy of the weights on the model's tp ranks, so it works from any backend's model."""
        from .build import build
        kw = self.build_kwargs
        if kw is None:
            raise ConfigError("compile() needs a model loaded with from_pretrained (this one came from artifacts)")
        return build(kw["model_dir"], out, kw["draft"], kw["draft_kind"], self.setup.k if kw["draft_kind"] else None,
                     self.ranks.tp, self.buckets, self.setup.dtype, backend, pack_weights, progress)

    @classmethod
    def from_artifacts(cls, art_dir, tp_degree: int | None = None, verify_hashes: bool = True,
                       call_timeout_s: float | None = None):
        """Load what `python -m compile.build` (or `compile()`) wrote; generates exactly what from_pretrained
        generates. The manifest is verified first (files, sizes, sha256, weights), then the host (the backend's
        check: torch / Neuron stack, TP degree)."""
        from .manifest import verify
        art_dir = Path(art_dir)
        manifest = verify(art_dir, deep=verify_hashes)
        be = backends.check_host(manifest, tp_degree)
        w = manifest["weights"]
        where = lambda role: str(art_dir / w[role]["dir"]) if w[role]["packed"] else w[role]["dir"]  # noqa: E731
        setup = GraphSetup.from_manifest(manifest, VoxtralConfig.from_dir(where("target")))
        build_kwargs = dict(model_dir=where("target"), draft=where("draft") if "draft" in w else None,
                            draft_kind=setup.draft_kind, k=setup.k if setup.draft_kind else None, dtype=setup.dtype,
                            buckets=setup.buckets)
        ranks, stats = be.load(art_dir, manifest, build_kwargs, call_timeout_s)
        return cls(load_tokenizer(where("target")), ranks, be, where("target"), build_kwargs, stats)

    def close(self) -> None:
        """Stop the rank worker processes (tp_degree > 1); also done at garbage collection and interpreter exit."""
        self.closed = True
        self.ranks.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def draft_kind(self) -> str | None:
        return self.setup.draft_kind

    def run(self, tag: str, bucket: int, *inputs):
        """Call one graph. Inputs must have exactly the declared shapes: what a compiled graph would accept."""
        if self.closed:
            raise ModelClosedError("the model is closed (close() was called); create a new one")
        if signature(inputs) != self.signatures[(tag, bucket)]:
            raise ContractViolation(f"{tag}[{bucket}] called with shapes {signature(inputs)}, "
                                    f"compiled for {self.signatures[(tag, bucket)]}")
        return self.ranks.run(tag, bucket, *inputs)

    def generate(self, input_ids: torch.Tensor, input_features: torch.Tensor, max_new_tokens: int = 128,
                 timings: dict | None = None, return_stats: bool = False, on_tokens=None):
        """Greedy continuation of input_ids -> LongTensor [1, n_new] (EOS included when reached); with a draft the
        tokens are the same, fewer target passes. return_stats=True -> (ids, SpecStats). on_tokens(new_ids) is
        called with the newly emitted ids as the host loop accepts them (streaming); an exception it raises
        stops generation."""
        s = self.setup
        input_ids, input_features = self.check_inputs(input_ids, input_features)
        s.check_capacity(input_ids.shape[-1], max_new_tokens)
        stats = SpecStats(s.draft_kind or "none", s.k)
        t0 = time.perf_counter()
        first, position, drafter = self.prefill(input_ids, input_features, stats)
        t1 = time.perf_counter()
        eos = self.cfg.text.eos_token_id
        if on_tokens is not None:
            on_tokens([first])
        if drafter is None:
            tokens = gen.decode(self.run, first, position, max_new_tokens, eos, self.buckets, on_tokens)
            stats.target_passes += len(tokens) - 1
        else:
            tokens = gen.speculate(self.run, drafter, first, position, max_new_tokens, eos, self.buckets, s.k, stats,
                                   on_tokens)
        t2 = time.perf_counter()
        stats.generated = len(tokens)
        if timings is not None:
            timings.update(prefill_s=t1 - t0, decode_s=t2 - t1, new_tokens=len(tokens),
                           decode_tokens_per_s=(len(tokens) - 1) / (t2 - t1) if len(tokens) > 1 else 0.0)
        ids_out = torch.tensor([tokens], dtype=torch.long)
        return (ids_out, stats) if return_stats else ids_out

    def check_inputs(self, input_ids, input_features):
        """Tensors (lists / numpy arrays converted) of the right kinds: integer ids inside the vocabulary, finite
        floating-point features. Shapes are checked by gen.prepare_prefill."""
        import numpy as np
        if isinstance(input_ids, (list, tuple, np.ndarray)):
            input_ids = torch.as_tensor(np.asarray(input_ids))
        if isinstance(input_features, np.ndarray):
            input_features = torch.from_numpy(input_features)
        if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or input_ids.is_complex() \
                or input_ids.dtype == torch.bool:
            raise ConfigError(f"input_ids must be an integer tensor (or list / numpy array of ints), got "
                              f"{getattr(input_ids, 'dtype', type(input_ids).__name__)}")
        if input_ids.numel() == 0:
            raise ConfigError("input_ids is empty")
        vocab = self.cfg.text.vocab_size
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= vocab:
            raise ConfigError(f"input_ids holds token id {lo if lo < 0 else hi}, outside the vocabulary [0, {vocab})")
        if not isinstance(input_features, torch.Tensor) or not input_features.is_floating_point():
            raise ConfigError(f"input_features must be a floating-point tensor, got "
                              f"{getattr(input_features, 'dtype', type(input_features).__name__)}")
        if not torch.isfinite(input_features).all():
            raise ConfigError("input_features contains NaN or infinite values")
        return input_ids, input_features.float()

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

    def prepare(self, audio, language: str | None = None, sampling_rate: int | None = None, strict: bool = False):
        """strict=True refuses a truncated audio file instead of warning (AudioWarning) and using what is present."""
        a = self.cfg.audio
        samples = load_audio(audio, sampling_rate, max_seconds=self.buckets.max_audio_seconds(self.cfg), strict=strict)
        prompt = build_prompt(self.tokenizer, samples, language, a.num_mel_bins, a.mel_frames_per_chunk)
        self.buckets.chunk_bucket(prompt.input_features.shape[0], self.cfg)  # too long -> AudioTooLongError now
        return prompt

    def transcribe(self, audio, language: str | None = None, sampling_rate: int | None = None,
                   max_new_tokens: int = 256, strict: bool = False) -> Transcription:
        t0 = time.perf_counter()
        prompt = self.prepare(audio, language, sampling_rate, strict)
        timings = {"features_s": time.perf_counter() - t0, "audio_s": prompt.duration_s}
        ids, stats = self.generate(prompt.input_ids, prompt.input_features, max_new_tokens, timings, True)
        timings["total_s"] = time.perf_counter() - t0
        ids = ids[0].tolist()
        return Transcription(text=decode(self.tokenizer, ids), token_ids=ids, timings=timings, stats=stats)
