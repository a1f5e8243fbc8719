"""The graphs: the single source of truth for tags, buckets and input signatures.

Every graph is an nn.Module whose forward takes positional fixed-shape tensors (int32 ids and indices) and
returns a tuple of tensors. The KV caches are buffers of the shared model, updated in place. The build, every
backend and the runtime enumerate graphs through `graph_plan` and build inputs through `example_inputs`; the
capacity rules (longest audio, new tokens that fit) and the manifest form of buckets and setup live here too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .config import HOP, SAMPLE_RATE, VoxtralConfig
from .errors import AudioTooLongError, ConfigError
from .model import VoxtralModel, causal_visible, cached_visible
from .kernels import ops

I32 = torch.int32


@dataclass(frozen=True)
class Buckets:
    audio_chunks: tuple[int, ...] = (1, 2, 4, 10)            # 30 s chunks: up to 5 minutes
    kv_lengths: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)
    text_slack: int = 16  # prompt tokens that are not audio: [BOS][INST][BEGIN_AUDIO] ... [/INST] lang:xx [TRANSCRIBE]
    batch_sizes: tuple[int, ...] = (1,)  # sequences per decode-side call; the largest is the number of KV slots

    def __post_init__(self):
        for name in ("audio_chunks", "kv_lengths", "batch_sizes"):
            sizes = getattr(self, name)
            if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
                raise ConfigError(f"{name} buckets must be positive, increasing and non-empty, got {sizes}")

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    def batch_bucket(self, n: int) -> int:
        for b in self.batch_sizes:
            if b >= n:
                return b
        raise ConfigError(f"{n} sequences exceed the largest batch bucket ({self.max_batch})")

    def prompt_length(self, n_chunks: int, cfg: VoxtralConfig) -> int:
        return n_chunks * cfg.audio.tokens_per_chunk + self.text_slack

    def chunk_bucket(self, n_chunks: int, cfg: VoxtralConfig) -> int:
        for b in self.audio_chunks:
            if b >= n_chunks:
                return b
        limit = self.audio_chunks[-1] * cfg.audio.mel_frames_per_chunk // 100
        raise AudioTooLongError(
            f"audio needs {n_chunks} chunks of 30 s but the largest audio bucket holds {self.audio_chunks[-1]} "
            f"({limit} s); rebuild with a larger audio_chunks bucket")

    def kv_bucket(self, length: int) -> int:
        for b in self.kv_lengths:
            if b >= length:
                return b
        raise ConfigError(f"sequence of {length} tokens exceeds the largest KV bucket ({self.kv_lengths[-1]})")

    def validate(self, cfg: VoxtralConfig) -> None:
        longest_prompt = self.prompt_length(self.audio_chunks[-1], cfg)
        if longest_prompt >= self.kv_lengths[-1]:
            raise ConfigError(f"largest KV bucket {self.kv_lengths[-1]} cannot hold the longest prompt "
                              f"({longest_prompt} tokens for {self.audio_chunks[-1]} chunks)")

    def max_audio_seconds(self, cfg: VoxtralConfig) -> float:
        """The longest audio the largest audio bucket holds (the one audio limit of the API, CLI and server)."""
        return self.audio_chunks[-1] * cfg.audio.mel_frames_per_chunk * HOP / SAMPLE_RATE

    def to_dict(self) -> dict:
        return {"audio_chunks": list(self.audio_chunks), "kv_lengths": list(self.kv_lengths),
                "text_slack": self.text_slack, "batch_sizes": list(self.batch_sizes)}

    @classmethod
    def from_dict(cls, d: dict) -> "Buckets":
        return cls(tuple(d["audio_chunks"]), tuple(d["kv_lengths"]), d["text_slack"], tuple(d["batch_sizes"]))



def batch_sizes_up_to(max_batch_size: int) -> tuple[int, ...]:
    """Batch buckets 1, 2, 4, ... up to max_batch_size (included)."""
    if not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool) or max_batch_size < 1:
        raise ConfigError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
    return tuple([1 << i for i in range(max_batch_size.bit_length()) if 1 << i < max_batch_size] + [max_batch_size])


BUCKET_KEYS = {"audio": "audio_chunks", "kv": "kv_lengths", "batch": "batch_sizes"}


def parse_buckets(text: str | None) -> Buckets:
    """'audio=1,2:kv=512,1024' (the CLI's --buckets) -> Buckets; a ConfigError names the part that is wrong."""
    if not text:
        return Buckets()
    example = "expected e.g. audio=1,2,4:kv=512,1024:batch=1,2,4,8"
    values = {}
    for part in text.split(":"):
        key, eq, vals = part.partition("=")
        if not eq:
            raise ConfigError(f"--buckets {text!r}: {part!r} has no '=': {example}")
        if key not in BUCKET_KEYS:
            raise ConfigError(f"--buckets {text!r}: unknown key {key!r} (known: {', '.join(BUCKET_KEYS)}); {example}")
        if key in values:
            raise ConfigError(f"--buckets {text!r}: {key} given twice")
        try:
            nums = tuple(int(x) for x in vals.split(","))
        except ValueError:
            raise ConfigError(f"--buckets {text!r}: {key}={vals!r} is not a comma-separated list of integers") from None
        if any(n < 1 for n in nums) or list(nums) != sorted(set(nums)):
            raise ConfigError(f"--buckets {text!r}: {key} sizes must be positive and strictly increasing, got {vals}")
        values[BUCKET_KEYS[key]] = nums
    return Buckets(**values)


# ---------------------------------------------------------------- what is being compiled

DRAFT_KINDS = ("layers", "dflash", "ngram")
DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # the command lines' --dtype
DTYPES = {str(t): t for t in DTYPE_NAMES.values()}  # the manifest's dtype names


@dataclass(frozen=True)
class GraphSetup:
    """Everything that decides the set of graphs and their input signatures."""
    cfg: VoxtralConfig
    buckets: Buckets
    dtype: torch.dtype = torch.float32
    draft_kind: str | None = None
    k: int = 0                                # proposals per verify
    capture_layers: tuple[int, ...] = ()      # DFlash: target layers whose outputs feed the draft
    dflash_block: int = 0
    draft_own_audio: bool = False             # layer draft whose audio tower differs from the target's

    @property
    def feature_dim(self) -> int:
        return len(self.capture_layers) * self.cfg.text.hidden_size

    @property
    def lookahead(self) -> int:
        """KV slots a verify / draft block may write past the last emitted token."""
        return self.k + self.dflash_block

    @property
    def rows_per_call(self) -> int:
        """The most rows a decode-side call computes: a verify or DFlash block of every sequence of a full batch."""
        return self.buckets.max_batch * max(self.k + 1, self.dflash_block)

    def token_room(self, prompt_len: int) -> int:
        """New tokens that fit the largest KV bucket after a prompt of prompt_len tokens (the one capacity rule)."""
        return self.buckets.kv_lengths[-1] - prompt_len - self.lookahead

    def check_capacity(self, prompt_len: int, max_new_tokens: int) -> None:
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
            raise ConfigError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if max_new_tokens > self.token_room(prompt_len):
            room = (f" + speculation room (K={self.k}" + (f" + DFlash block {self.dflash_block}" if self.dflash_block
                                                         else "") + ")") if self.lookahead else ""
            raise ConfigError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}){room} exceeds the "
                              f"largest KV bucket ({self.buckets.kv_lengths[-1]}); lower "
                              f"{'K or ' if self.lookahead else ''}max_new_tokens, or add a larger kv bucket")

    def to_manifest(self) -> dict:
        """What a manifest records of the setup (config and dtype are recorded beside it)."""
        return {"draft_kind": self.draft_kind, "k": self.k, "buckets": self.buckets.to_dict(),
                "graph_setup": {"capture_layers": list(self.capture_layers), "dflash_block": self.dflash_block,
                                "draft_own_audio": self.draft_own_audio}}

    @classmethod
    def from_manifest(cls, manifest: dict, cfg: VoxtralConfig) -> "GraphSetup":
        g = manifest["graph_setup"]
        return cls(cfg, Buckets.from_dict(manifest["buckets"]), DTYPES[manifest["dtype"]], manifest["draft_kind"],
                   manifest["k"], tuple(g["capture_layers"]), g["dflash_block"], g["draft_own_audio"])


# The model whose KV cache each graph writes (None: none). On CPU the write is in place; the Neuron graphs also
# return the cache and alias it to the input state (neuron.py).
CACHE_OWNER = {"audio_encoder": None, "context_encoding": "target", "token_generation": "target", "verify": "target",
               "draft_context_encoding": "draft", "draft_fused_k": "draft", "dflash_context": "draft",
               "dflash_draft": "draft"}


def kv_caches(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache) of a VoxtralModel or a DFlashDraft."""
    m = getattr(model, "language_model", model)
    return m.k_cache, m.v_cache


# Decode-side graphs: one per (KV bucket, batch bucket), every row a sequence in its own KV slot. Prefill-side graphs
# run one sequence (batch 1) and write only its slot.
BATCHED_TAGS = ("token_generation", "verify", "draft_fused_k", "dflash_draft")


@dataclass(frozen=True)
class GraphSpec:
    tag: str
    bucket: int
    batch: int = 1

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.tag, self.bucket, self.batch)

    @property
    def name(self) -> str:
        return f"{self.tag}[{self.bucket}" + (f", batch {self.batch}]" if self.batch > 1 else "]")

    @property
    def stem(self) -> str:
        """File name stem of its per-rank artifacts."""
        return f"{self.tag}.{self.bucket}" + (f".b{self.batch}" if self.batch > 1 else "")


def graph_key(tag: str, bucket: int, inputs: tuple) -> tuple[str, int, int]:
    """The graph a call goes to: decode-side graphs by their batch too, the rows of the first input."""
    return (tag, bucket, inputs[0].shape[0] if tag in BATCHED_TAGS else 1)


def graph_plan(setup: GraphSetup) -> list[GraphSpec]:
    """Every (tag, bucket, batch) the configuration needs, in compile order."""
    b = setup.buckets
    per_chunks = lambda tag: [GraphSpec(tag, n) for n in b.audio_chunks]  # noqa: E731
    per_kv = lambda tag: [GraphSpec(tag, n, m) for m in b.batch_sizes for n in b.kv_lengths]  # noqa: E731
    plan = per_chunks("audio_encoder") + per_chunks("context_encoding") + per_kv("token_generation")
    if setup.draft_kind in DRAFT_KINDS:
        plan += per_kv("verify")
    if setup.draft_kind == "layers":
        plan += per_chunks("draft_context_encoding") + per_kv("draft_fused_k")
    if setup.draft_kind == "dflash":
        plan += per_chunks("dflash_context") + per_kv("dflash_draft")
    return plan


def example_inputs(spec: GraphSpec, setup: GraphSetup) -> tuple:
    """One example tuple per graph: the trace example and the routing key (shapes)."""
    cfg, a, h, n, m = setup.cfg, setup.cfg.audio, setup.cfg.text.hidden_size, spec.bucket, spec.batch
    zeros_i = lambda *shape: torch.zeros(*shape, dtype=I32)  # noqa: E731
    mel = lambda: torch.zeros(n, a.num_mel_bins, a.mel_frames_per_chunk)  # noqa: E731
    if spec.tag == "audio_encoder":
        return (mel(),)
    slot = zeros_i(m)
    if spec.tag in ("context_encoding", "draft_context_encoding", "dflash_context"):
        n_audio, p = n * a.tokens_per_chunk, setup.buckets.prompt_length(n, cfg)
        ids, positions = zeros_i(1, p), torch.full((n_audio,), p, dtype=I32)
        embeds = torch.zeros(n_audio, h, dtype=setup.dtype)
        if spec.tag == "context_encoding":
            return (ids, embeds, positions, zeros_i(1), slot)
        if spec.tag == "draft_context_encoding":
            return (ids, mel() if setup.draft_own_audio else embeds, positions, slot)
        return (torch.zeros(1, p, setup.feature_dim, dtype=setup.dtype), slot)
    mask = zeros_i(m, n)
    if spec.tag == "token_generation":
        return (zeros_i(m, 1), zeros_i(m), mask, slot)
    if spec.tag == "verify":
        return (zeros_i(m, setup.k + 1), zeros_i(m, setup.k + 1), mask, zeros_i(m), slot)
    if spec.tag == "draft_fused_k":
        return (zeros_i(m, 2), zeros_i(m, 2), mask, slot)
    if spec.tag == "dflash_draft":
        blk = setup.dflash_block
        return (torch.zeros(m, blk, setup.feature_dim, dtype=setup.dtype), zeros_i(m, blk), zeros_i(m, 1),
                zeros_i(m), mask, slot)
    raise ConfigError(f"unknown graph tag {spec.tag!r}")


# ---------------------------------------------------------------- graph modules

class AudioEncoderGraph(nn.Module):
    """(mel [n, n_mels, frames]) -> (audio_embeds [n * tokens_per_chunk, H],)"""

    def __init__(self, model: VoxtralModel):
        super().__init__()
        self.model = model

    def forward(self, mel):
        return (self.model.encode_audio(mel),)


class ContextEncodingGraph(nn.Module):
    """(input_ids [1, P], audio_embeds [A, H], audio_positions [A], last_index [1], slot [1])
    -> (first_token [1], [features [1, P, n_capture*H]])   writes KV for positions 0..P-1 of its slot."""

    def __init__(self, model: VoxtralModel, capture_layers=()):
        super().__init__()
        self.model, self.capture_layers = model, tuple(capture_layers)

    def forward(self, input_ids, audio_embeds, audio_positions, last_index, slot):
        x = self.model.embed_with_audio(input_ids, audio_embeds, audio_positions)
        t, dev = x.shape[1], input_ids.device
        h, captured = self.model.language_model(x, torch.arange(t, dtype=I32, device=dev)[None], slot, None,
                                                causal_visible(t, dev), self.capture_layers)
        first = self.model.greedy(h.index_select(1, last_index.long()))[0]
        return (first, torch.cat(captured, dim=-1)) if captured else (first,)


class DraftContextEncodingGraph(nn.Module):
    """Layer-draft prefill: (input_ids [1, P], audio_embeds [A, H] or mel [n, n_mels, frames], audio_positions [A],
    slot [1]) -> (rows_written [1],)   writes the draft's KV so its slot holds the audio context. (A graph needs at
    least one output to be serialized; the row count is the cheapest honest one.)"""

    def __init__(self, draft: VoxtralModel, own_audio: bool):
        super().__init__()
        self.draft, self.own_audio = draft, own_audio

    def forward(self, input_ids, audio, audio_positions, slot):
        embeds = self.draft.encode_audio(audio) if self.own_audio else audio
        x = self.draft.embed_with_audio(input_ids, embeds, audio_positions)
        t, dev = x.shape[1], input_ids.device
        self.draft.language_model(x, torch.arange(t, dtype=I32, device=dev)[None], slot, None, causal_visible(t, dev))
        return (torch.full((1,), t, dtype=I32, device=dev),)


class TokenGenerationGraph(nn.Module):
    """(tokens [b, 1], positions [b], cache_mask [b, S], slots [b]) -> (next_tokens [b],)   one step of b sequences."""

    def __init__(self, model: VoxtralModel, kv_len: int):
        super().__init__()
        self.model, self.kv_len = model, kv_len

    def forward(self, tokens, positions, cache_mask, slots):
        x = self.model.language_model.embed_tokens(tokens.long())
        pos = positions[:, None]
        h, _ = self.model.language_model(x, pos, slots, self.kv_len, cached_visible(pos, cache_mask))
        return (self.model.greedy(h[:, 0]),)


class VerifyGraph(nn.Module):
    """(candidates [b, K+1], positions [b, K+1], cache_mask [b, S], n_valid [b], slots [b])
    -> (target_tokens [b, K+1], accepted [b], bonus [b], [features [b, K+1, n_capture*H]])
    One target pass over each sequence's last token and its proposals; greedy accept per sequence in the graph."""

    def __init__(self, model: VoxtralModel, kv_len: int, capture_layers=()):
        super().__init__()
        self.model, self.kv_len, self.capture_layers = model, kv_len, tuple(capture_layers)

    def forward(self, candidates, positions, cache_mask, n_valid, slots):
        lm = self.model.language_model
        h, captured = lm(lm.embed_tokens(candidates.long()), positions, slots, self.kv_len,
                         cached_visible(positions, cache_mask), self.capture_layers)
        target, accepted, bonus = ops.greedy_accept(candidates, self.model.greedy(h), n_valid)
        out = (target, accepted, bonus)
        return out + (torch.cat(captured, dim=-1),) if captured else out


class DraftFusedKGraph(nn.Module):
    """(tokens [b, 2] = previous and last accepted, positions [b, 2], cache_mask [b, S], slots [b])
    -> (proposals [b, K],)   K greedy steps of the layer draft unrolled in one call. The previous token is re-fed
    because its K/V are missing from the draft cache when all K proposals of the last round were accepted."""

    def __init__(self, draft: VoxtralModel, kv_len: int, k: int):
        super().__init__()
        self.draft, self.kv_len, self.k = draft, kv_len, k

    def forward(self, tokens, positions, cache_mask, slots):
        lm = self.draft.language_model
        start, pos = positions[:, 0], positions
        x = lm.embed_tokens(tokens.long())
        proposals = []
        for _ in range(self.k):
            h, _ = lm(x, pos, slots, self.kv_len, cached_visible(pos, cache_mask, start))
            nxt = self.draft.greedy(h[:, -1])
            proposals.append(nxt)
            x = lm.embed_tokens(nxt.long())[:, None]
            pos = pos[:, -1:] + 1
        return (torch.stack(proposals, dim=1),)


class DFlashContextGraph(nn.Module):
    """(features [1, P, n_capture*H], slot [1]) -> (rows_written [1],)   context K/V of prompt positions 0..P-1."""

    def __init__(self, dflash):
        super().__init__()
        self.dflash = dflash

    def forward(self, features, slot):
        p, dev = features.shape[1], features.device
        self.dflash.write_context(features, torch.arange(p, dtype=I32, device=dev)[None], slot)
        return (torch.full((1,), p, dtype=I32, device=dev),)


class DFlashDraftGraph(nn.Module):
    """(new_features [b, B, F], new_positions [b, B], anchors [b, 1], anchor_positions [b], ctx_mask [b, S],
    slots [b]) -> (proposals [b, K],)
    Appends context K/V of newly accepted positions (padding rows go to not-yet-valid rows), then one pass
    over each block [anchor, mask * (B-1)] at anchor_position.. proposes the tokens of block rows 1..K."""

    def __init__(self, dflash, target: VoxtralModel, kv_len: int, k: int):
        super().__init__()
        self.dflash, self.target, self.kv_len, self.k = dflash, target, kv_len, k

    def forward(self, new_features, new_positions, anchors, anchor_positions, ctx_mask, slots):
        self.dflash.write_context(new_features, new_positions, slots)
        n, blk, dev = anchors.shape[0], self.dflash.cfg.block_size, anchors.device
        mask_ids = torch.full((n, blk - 1), self.dflash.cfg.mask_token_id, dtype=I32, device=dev)
        block = self.target.language_model.embed_tokens(torch.cat([anchors, mask_ids], dim=1).long())
        positions = anchor_positions[:, None] + torch.arange(blk, dtype=I32, device=dev)
        h = self.dflash.propose_hidden(block, positions, ctx_mask, slots)
        return (self.target.greedy(h[:, 1:self.k + 1]),)


def build_graph(spec: GraphSpec, setup: GraphSetup, target: VoxtralModel, draft=None) -> nn.Module:
    tag, n = spec.tag, spec.bucket
    if tag == "audio_encoder":
        return AudioEncoderGraph(target)
    if tag == "context_encoding":
        return ContextEncodingGraph(target, setup.capture_layers)
    if tag == "token_generation":
        return TokenGenerationGraph(target, n)
    if tag == "verify":
        return VerifyGraph(target, n, setup.capture_layers)
    if tag == "draft_context_encoding":
        return DraftContextEncodingGraph(draft, setup.draft_own_audio)
    if tag == "draft_fused_k":
        return DraftFusedKGraph(draft, n, setup.k)
    if tag == "dflash_context":
        return DFlashContextGraph(draft)
    if tag == "dflash_draft":
        return DFlashDraftGraph(draft, target, n, setup.k)
    raise ConfigError(f"unknown graph tag {tag!r}")
