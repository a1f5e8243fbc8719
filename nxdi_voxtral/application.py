"""NxDVoxtralSpecDec: the user-facing application (load target and draft, generate, transcribe)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from . import backends, generate as gen
from .config import VoxtralConfig
from .contract import ContractViolation, check_distinct_signatures, signature
from .backends import EAGER, Backend
from .engine import Engine, check_request
from .errors import CheckpointError, ConfigError, ModelClosedError
from .graphs import Buckets, GraphSetup, batch_sizes_up_to, example_inputs, graph_key, graph_plan
from .tp import layout
from .processing import build_prompt, decode, load_audio, load_tokenizer
from .speculative import DFlashDrafter, LayerDrafter, NgramDrafter, SpecStats


MAX_AUDIO_S = 3 * 3600.0  # the longest audio transcribe() windows by default
SEARCH_S = 10.0  # a window is cut at the quietest point of its last SEARCH_S seconds (a pause between words)


@dataclass
class Segment:
    """One window of long audio: seconds of the original audio and its transcript."""
    start: float
    end: float
    text: str
    token_ids: list[int]


@dataclass
class Transcription:
    text: str
    token_ids: list[int]
    timings: dict = field(default_factory=dict)
    stats: SpecStats | None = None
    segments: list[Segment] = field(default_factory=list)  # one per window (one for audio within one window)


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
        self.signatures = {s.key: signature(example_inputs(s, self.setup)) for s in graph_plan(self.setup)}
        check_distinct_signatures(self.signatures)
        s = self.setup
        self.drafter = {"layers": lambda: LayerDrafter(self.run, self.buckets, s.k),
                        "dflash": lambda: DFlashDrafter(self.run, self.buckets, s.k, s.dflash_block, s.feature_dim,
                                                        s.dtype),
                        "ngram": lambda: NgramDrafter(s.k)}.get(s.draft_kind, lambda: None)()

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
                        backend: str = "eager", max_batch_size: int | None = None):
        """call_timeout_s (tp_degree > 1): limit of one graph call before a silent rank is reported (WorkerError);
        default NXDI_VOXTRAL_CALL_TIMEOUT_S or 600 s, 0 for none.
        backend: a name from nxdi_voxtral.backends (eager, inductor, ...) whose graphs can be prepared from a
        checkpoint at load; the torch.compile backends compile every graph here and fill `compile_stats`.
        max_batch_size: batch buckets 1, 2, 4, ... up to it (default: the buckets' own, batch 1 unless given)."""
        be = backends.get(backend)
        if max_batch_size is not None:
            buckets = replace(buckets or Buckets(), batch_sizes=batch_sizes_up_to(max_batch_size))
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
        key = graph_key(tag, bucket, inputs)
        if signature(inputs) != self.signatures.get(key):
            raise ContractViolation(f"{tag}[{bucket}] called with shapes {signature(inputs)}, compiled for "
                                    f"{[sig for k, sig in self.signatures.items() if k[:2] == key[:2]]}")
        return self.ranks.run(tag, bucket, *inputs)

    def generate(self, input_ids, input_features, max_new_tokens: int = 128, timings: dict | None = None,
                 return_stats: bool = False, on_tokens=None):
        """Greedy continuation of input_ids -> LongTensor [1, n_new] (EOS included when reached); with a draft the
        tokens are the same, fewer target passes. return_stats=True -> (ids, SpecStats). on_tokens(new_ids) is
        called with the newly emitted ids as the host loop accepts them (streaming); an exception it raises
        stops generation.

        A batch: lists of input_ids and input_features, one entry per prompt -> a list in the same order (of ids,
        or of (ids, stats)); on_tokens(index, new_ids). Up to the largest batch bucket run at once, the rest join
        as slots free up; each result is exactly what the single call gives."""
        batched = isinstance(input_features, (list, tuple))
        if batched and (not isinstance(input_ids, (list, tuple)) or len(input_ids) != len(input_features)):
            raise ConfigError("a batch needs one input_ids entry per input_features entry (two lists of one length)")
        prompts = list(zip(input_ids, input_features)) if batched else [(input_ids, input_features)]
        prompts = [self.check_inputs(ids, feats) for ids, feats in prompts]
        for ids, _ in prompts:
            self.setup.check_capacity(ids.shape[-1], max_new_tokens)
        callback = on_tokens if batched or on_tokens is None else lambda i, new: on_tokens(new)
        seqs = self.generate_sequences(iter(prompts), max_new_tokens, timings, callback)
        out = [(torch.tensor([s.tokens], dtype=torch.long), s.stats) for s in seqs]
        out = [o if return_stats else o[0] for o in out]
        return out if batched else out[0]

    def generate_sequences(self, prompts, max_new_tokens: int, timings: dict | None = None, on_tokens=None):
        """The batch loop: prompts (an iterator of checked (input_ids, input_features)) are prefilled into free KV
        slots, pulled only when a slot is free (so a long stream holds at most a batch of features), and every
        active sequence steps together -> the finished gen.Sequence of each prompt, in order."""
        batch, done, prompts = gen.Batch(self.buckets), {}, enumerate(prompts)
        prefill_s = decode_s = 0.0
        pending = True
        while pending or batch.active:
            while pending and batch.free:
                nxt = next(prompts, None)
                if nxt is None:
                    pending = False
                    break
                t0 = time.perf_counter()
                i, (ids, feats) = nxt
                seq = self.start(ids, feats, max_new_tokens, batch.take_slot(), i, on_tokens)
                prefill_s += time.perf_counter() - t0
                batch.active.append(seq)
                if seq.done:
                    batch.release(seq)
                    done[i] = seq
            if batch.active:
                t0 = time.perf_counter()
                for seq in batch.step(self.run, self.drafter, self.setup.k):
                    done[seq.index] = seq
                decode_s += time.perf_counter() - t0
        seqs = [done[i] for i in range(len(done))]
        for seq in seqs:
            seq.stats.generated = len(seq.tokens)
        if timings is not None:
            steps = sum(len(seq.tokens) - 1 for seq in seqs)
            timings.update(prefill_s=prefill_s, decode_s=decode_s, new_tokens=sum(len(s.tokens) for s in seqs),
                           decode_tokens_per_s=steps / decode_s if steps and decode_s > 0 else 0.0)
        return seqs

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

    def start(self, input_ids: torch.Tensor, input_features: torch.Tensor, max_new_tokens: int, slot: int,
              index: int = 0, on_tokens=None) -> gen.Sequence:
        """Prefill one sequence into KV slot `slot` (audio encoder, target prefill, the draft's own prefill) -> the
        sequence, its first token emitted. on_tokens(index, new_ids) streams its tokens."""
        s = self.setup
        nb, mel, ids, audio_positions, last_index = gen.prepare_prefill(input_ids, input_features, self.cfg,
                                                                        self.buckets)
        slot_ids = torch.tensor([slot], dtype=gen.I32)
        (audio_embeds,) = self.run("audio_encoder", nb, mel)
        first, *prompt_features = self.run("context_encoding", nb, ids, audio_embeds, audio_positions, last_index,
                                           slot_ids)
        position = int(last_index[0]) + 1
        stream = None if on_tokens is None else lambda new: on_tokens(index, new)
        seq = gen.Sequence(slot, [], position, max_new_tokens, self.cfg.text.eos_token_id,
                           SpecStats(s.draft_kind or "none", s.k), int(ids[0, position - 1]), stream, index=index)
        if s.draft_kind == "layers":
            self.drafter.prefill(seq, nb, ids, mel if s.draft_own_audio else audio_embeds, audio_positions)
        elif s.draft_kind == "dflash":
            self.drafter.prefill(seq, nb, prompt_features[0])
        seq.emit([int(first[0])])
        return seq

    def prepare(self, audio, language: str | None = None, sampling_rate: int | None = None, strict: bool = False):
        """strict=True refuses a truncated audio file instead of warning (AudioWarning) and using what is present."""
        a = self.cfg.audio
        samples = load_audio(audio, sampling_rate, max_seconds=self.buckets.max_audio_seconds(self.cfg), strict=strict)
        prompt = build_prompt(self.tokenizer, samples, language, a.num_mel_bins, a.mel_frames_per_chunk)
        self.buckets.chunk_bucket(prompt.input_features.shape[0], self.cfg)  # too long -> AudioTooLongError now
        return prompt

    def window_seconds(self) -> tuple[float, float]:
        """(window, search) seconds for long audio: windows as long as the largest audio bucket (a window of at most
        that many source samples resamples to at most its 16 kHz length, so it fits), each cut at the quietest point
        of its last `search` seconds."""
        window_s = self.buckets.max_audio_seconds(self.cfg)
        return window_s, min(SEARCH_S, window_s / 4)

    def window_prompts(self, audio, language: str | None = None, sampling_rate: int | None = None,
                       max_audio_s: float = MAX_AUDIO_S, strict: bool = False):
        """Audio -> a lazy iterator of (start_s, end_s, Prompt), one per window (windows.py; one window for audio
        that fits the largest audio bucket). The header is checked now; a window is decoded when it is pulled."""
        from .windows import audio_windows
        window_s, search_s = self.window_seconds()
        windows = audio_windows(audio, sampling_rate, window_s=window_s, search_s=search_s, max_seconds=max_audio_s,
                                strict=strict)
        a = self.cfg.audio
        return ((w.start_s, w.end_s, build_prompt(self.tokenizer, w.samples, language, a.num_mel_bins,
                                                  a.mel_frames_per_chunk)) for w in windows)

    def transcribe(self, audio, language: str | None = None, sampling_rate: int | None = None,
                   max_new_tokens: int = 256, strict: bool = False, max_audio_s: float = MAX_AUDIO_S):
        """Audio (a path, the bytes of an upload or an array with sampling_rate) -> Transcription; a list of them ->
        a list in order. Audio longer than the largest audio bucket, up to max_audio_s, is cut into windows at
        quiet points (windows.py); the windows run as sequences of one batch, their texts joined in order, one
        segment each. Every input's header is checked (typed errors) before anything is generated; files are
        decoded window by window, as slots free up, so memory holds about a batch of windows however long the
        audio. max_new_tokens applies per window."""
        from .processing import check_language
        batched = isinstance(audio, (list, tuple)) and len(audio) > 0 and not isinstance(audio[0], (int, float))
        clips = list(audio) if batched else [audio]
        t0 = time.perf_counter()
        check_language(language)
        streams = [self.window_prompts(c, language, sampling_rate, max_audio_s, strict) for c in clips]
        owners = []  # (clip, start, end) of every window, in the order of the prompts

        def prompts():
            for i, windows in enumerate(streams):
                for start, end, p in windows:
                    self.setup.check_capacity(p.input_ids.shape[-1], max_new_tokens)
                    owners.append((i, start, end))
                    yield self.check_inputs(p.input_ids, p.input_features)

        timings = {}
        seqs = self.generate_sequences(prompts(), max_new_tokens, timings)
        timings["total_s"] = time.perf_counter() - t0
        parts = [[] for _ in clips]
        for (i, start, end), seq in zip(owners, seqs):
            parts[i].append((Segment(start, end, decode(self.tokenizer, seq.tokens), seq.tokens), seq.stats))
        out = []
        for part in parts:
            segments, stats = [p[0] for p in part], [p[1] for p in part]
            text = segments[0].text if len(segments) == 1 else " ".join(s.text.strip() for s in segments)
            out.append(Transcription(text=text, token_ids=[t for s in segments for t in s.token_ids],
                                     timings={**timings, "audio_s": segments[-1].end}, stats=SpecStats.merged(stats),
                                     segments=segments))
        return out if batched else out[0]
