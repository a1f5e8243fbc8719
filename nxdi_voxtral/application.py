"""NxDVoxtralSpecDec: the user-facing application (load target and draft, generate, transcribe)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import generate as gen
from .config import VoxtralConfig
from .contract import ContractViolation, check_distinct_signatures, signature
from .engine import Engine, build_engine, check_request
from .errors import CheckpointError, ConfigError, ModelClosedError
from .graphs import Buckets, GraphSetup, example_inputs, graph_plan
from .tp import layout
from .workers import RankWorkers
from .processing import HOP, SAMPLE_RATE, build_prompt, decode, load_audio, load_tokenizer
from .speculative import DFlashDrafter, LayerDrafter, NgramDrafter, SpecStats

log = logging.getLogger(__name__)


@dataclass
class Transcription:
    text: str
    token_ids: list[int]
    timings: dict = field(default_factory=dict)
    stats: SpecStats | None = None


class NxDVoxtralSpecDec:
    """Voxtral transcription over fixed-shape graphs, optionally with a draft and tensor parallelism.

    The host loop (prefill, decode, speculation) runs here; graphs run in `self.engine` (one rank, this process)
    or in rank worker processes (tp_degree > 1), through the same `run(tag, bucket, *inputs)`."""

    def __init__(self, tokenizer, setup: GraphSetup, engine: Engine | None = None, workers: RankWorkers | None = None,
                 model_dir=None):
        self.tokenizer, self.setup, self.engine, self.workers = tokenizer, setup, engine, workers
        self.cfg, self.buckets, self.model_dir = setup.cfg, setup.buckets, model_dir
        self.model = engine.model if engine else None
        self.closed = False
        self.compile_stats: list[dict] | None = None  # backend "compiled": per graph seconds / cache hits (rank 0)
        self.draft = engine.draft if engine else None
        self.signatures = {(s.tag, s.bucket): signature(example_inputs(s, setup)) for s in graph_plan(setup)}
        check_distinct_signatures(self.signatures)

    @classmethod
    def from_pretrained(cls, model_dir, draft=None, draft_kind: str | None = None,
                        num_speculative_tokens: int | None = None, dtype: torch.dtype = torch.float32,
                        buckets: Buckets | None = None, tp_degree: int = 1, call_timeout_s: float | None = None,
                        backend: str = "eager", compile_cache=None):
        """call_timeout_s (tp_degree > 1): limit of one graph call before a silent rank is reported (WorkerError);
        default NXDI_VOXTRAL_CALL_TIMEOUT_S or 600 s, 0 for none.
        backend "compiled": torch.compile every graph at load (inductor on CPU, TorchNeuron's "neuron" backend on
        a Neuron host; nxdi_voxtral/compiled.py), from the compile cache under compile_cache when given
        (from_artifacts passes the artifact's); `compile_stats` then holds rank 0's seconds and cache hits."""
        if backend not in ("eager", "compiled"):
            raise ConfigError(f"backend must be 'eager' or 'compiled', got {backend!r}")
        draft_kind = check_request(draft, draft_kind, dtype)
        if draft is not None and draft_kind == "ngram":
            raise ConfigError(f"draft_kind='ngram' uses no draft checkpoint, but draft={str(draft)!r} was given")
        cfg = VoxtralConfig.from_dir(model_dir)
        tokenizer = load_tokenizer(model_dir)
        n_words = tokenizer.instruct_tokenizer.tokenizer.n_words
        if n_words > cfg.text.vocab_size:
            raise CheckpointError(f"{model_dir}: tokenizer has {n_words} tokens but the model's vocabulary is "
                                  f"{cfg.text.vocab_size}")
        if not isinstance(tp_degree, int) or tp_degree < 1:
            raise ConfigError(f"tp_degree must be a positive integer, got {tp_degree!r}")
        kwargs = dict(model_dir=model_dir, draft=draft, draft_kind=draft_kind, k=num_speculative_tokens,
                      dtype=dtype, buckets=buckets or Buckets())
        cache = None if compile_cache is None else str(compile_cache)
        if tp_degree == 1:
            engine = build_engine(**kwargs)
            m = cls(tokenizer, engine.setup, engine=engine, model_dir=model_dir)
            if backend == "compiled":
                m.compile_stats = engine.compile(cache)
            return m
        layout(cfg.text, cfg.audio, tp_degree, 0)  # tp that does not divide the heads: fail before spawning
        if backend == "compiled":
            from .compiled import compile_target
            kwargs["process_group"] = compile_target().process_group
        workers = RankWorkers(tp_degree, kwargs, call_timeout_s)
        m = cls(tokenizer, workers.setup, workers=workers, model_dir=model_dir)
        if backend == "compiled":
            try:
                m.compile_stats = workers.call("compile", cache)[0]  # every rank compiles its own graphs
            except BaseException:
                m.close()
                raise
        return m

    @classmethod
    def from_artifacts(cls, art_dir, tp_degree: int | None = None, verify_hashes: bool = True):
        """Load what `python -m compile.build` wrote; generates exactly what from_pretrained generates.
        The manifest is verified first (files, sizes, sha256, weights, backend / torch / TP of this host)."""
        from .manifest import check_host, verify
        art_dir = Path(art_dir)
        manifest = verify(art_dir, deep=verify_hashes)
        check_host(manifest, tp_degree)
        w = manifest["weights"]
        where = lambda role: str(art_dir / w[role]["dir"]) if w[role]["packed"] else w[role]["dir"]  # noqa: E731
        b = manifest["buckets"]
        dtype = {"torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16}[manifest["dtype"]]
        buckets = Buckets(tuple(b["audio_chunks"]), tuple(b["kv_lengths"]), b["text_slack"])
        if manifest["backend"] == "neuron":  # model.pt + NxD-sharded weights; the tokenizer from the target dir
            from .neuron import NeuronEngine
            g = manifest["graph_setup"]
            setup = GraphSetup(VoxtralConfig.from_dir(where("target")), buckets, dtype, manifest["draft_kind"],
                               manifest["k"], tuple(g["capture_layers"]), g["dflash_block"], g["draft_own_audio"])
            return cls(load_tokenizer(where("target")), setup, engine=NeuronEngine(art_dir, manifest))
        compiled = manifest["backend"] == "compiled"  # the graphs compile from the artifact's compile cache
        m = cls.from_pretrained(where("target"), draft=where("draft") if "draft" in w else None,
                                draft_kind=manifest["draft_kind"], dtype=dtype,
                                num_speculative_tokens=manifest["k"] if manifest["draft_kind"] else None,
                                buckets=Buckets(tuple(b["audio_chunks"]), tuple(b["kv_lengths"]), b["text_slack"]),
                                tp_degree=manifest["tp"], backend="compiled" if compiled else "eager",
                                compile_cache=art_dir / manifest["compile"]["cache_dir"] if compiled else None)
        if compiled:
            from .compiled import summary
            s = summary(m.compile_stats)
            log.info("compiled %d graphs in %.1f s (%d from the artifact's cache, %d recompiled)", s["graphs"],
                     s["seconds"], s["aot_cache_hits"], s["inductor_compiles"])
            if s["inductor_compiles"]:
                log.warning("%s: %d graph(s) missed the artifact's compile cache and were recompiled (another CPU "
                            "or compiler settings than the build host?)", art_dir, s["inductor_compiles"])
            return m
        graphs_dir = str(art_dir / "graphs")
        if m.workers is not None:
            m.workers.call("load_programs", graphs_dir, manifest["graphs"])
        else:
            m.engine.load_programs(graphs_dir, manifest["graphs"], rank=0)
        return m

    def close(self) -> None:
        """Stop the rank worker processes (tp_degree > 1); also done at garbage collection and interpreter exit."""
        self.closed = True
        if self.workers is not None:
            self.workers.close()

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
        if self.workers is not None:
            return self.workers.run(tag, bucket, *inputs)
        return self.engine.run(tag, bucket, *inputs)

    def generate(self, input_ids: torch.Tensor, input_features: torch.Tensor, max_new_tokens: int = 128,
                 timings: dict | None = None, return_stats: bool = False, on_tokens=None):
        """Greedy continuation of input_ids -> LongTensor [1, n_new] (EOS included when reached); with a draft the
        tokens are the same, fewer target passes. return_stats=True -> (ids, SpecStats). on_tokens(new_ids) is
        called with the newly emitted ids as the host loop accepts them (streaming); an exception it raises
        stops generation."""
        s = self.setup
        input_ids, input_features = self.check_inputs(input_ids, input_features)
        gen.check_capacity(input_ids.shape[-1], max_new_tokens, self.buckets)
        room = s.k + s.dflash_block  # slots a verify / draft block may write past the last emitted token
        if room and input_ids.shape[-1] + max_new_tokens + room > self.buckets.kv_lengths[-1]:
            block = f" + DFlash block {s.dflash_block}" if s.dflash_block else ""
            raise ConfigError(f"prompt ({input_ids.shape[-1]} tokens) + max_new_tokens ({max_new_tokens}) + "
                              f"speculation room (K={s.k}{block}) exceeds the largest KV bucket "
                              f"({self.buckets.kv_lengths[-1]}); lower K or max_new_tokens, or add a larger kv bucket")
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
        max_seconds = self.buckets.audio_chunks[-1] * a.mel_frames_per_chunk * HOP / SAMPLE_RATE
        samples = load_audio(audio, sampling_rate, max_seconds=max_seconds, strict=strict)
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
