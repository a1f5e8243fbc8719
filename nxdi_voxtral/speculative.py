"""The drafts: fused-K layer draft, DFlash block draft, n-gram prompt lookup; and speculation statistics."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .generate import I32, cache_mask


@dataclass
class SpecStats:
    """target_passes = prefill + verify (and plain decode) passes; tau = tokens emitted per verify call (accepted + 1,
    except where EOS or max_new_tokens cut the block: what was not emitted is not counted); acceptance_rate =
    accepted / proposed, cut blocks included (it measures the draft, not the output)."""
    draft_kind: str
    k: int
    target_passes: int = 1
    draft_passes: int = 0
    verify_calls: int = 0
    generated: int = 0
    steps: list = field(default_factory=list)   # per target pass after prefill: (proposed ids, accepted, emitted)

    def record(self, proposal: list[int], accepted: int, emitted: int) -> None:
        self.target_passes += 1
        self.verify_calls += bool(proposal)
        self.steps.append((list(proposal), accepted, emitted))

    @property
    def tau(self) -> float:
        verified = [e for p, _, e in self.steps if p]
        return sum(verified) / len(verified) if verified else 0.0

    @property
    def acceptance_rate(self) -> float:
        proposed = sum(len(p) for p, _, _ in self.steps)
        return sum(a for _, a, _ in self.steps) / proposed if proposed else 0.0

    def summary(self) -> dict:
        return {"draft_kind": self.draft_kind, "k": self.k, "tau": round(self.tau, 4),
                "acceptance_rate": round(self.acceptance_rate, 4), "target_passes": self.target_passes,
                "draft_passes": self.draft_passes, "verify_calls": self.verify_calls, "generated": self.generated}


class LayerDrafter:
    """The pruned-layer draft: its own prefill with the audio context, then K unrolled steps per call."""

    def __init__(self, run, buckets, k: int, stats: SpecStats, prompt_last_token: int):
        self.run, self.buckets, self.k, self.stats = run, buckets, k, stats
        self.prompt_last_token = prompt_last_token

    def prefill(self, n_chunks_bucket, ids, audio, audio_positions) -> None:
        self.run("draft_context_encoding", n_chunks_bucket, ids, audio, audio_positions)
        self.stats.draft_passes += 1

    def propose(self, tokens: list[int], position: int) -> list[int]:
        prev = tokens[-2] if len(tokens) > 1 else self.prompt_last_token
        bucket = self.buckets.kv_bucket(position + self.k)
        (proposals,) = self.run("draft_fused_k", bucket, torch.tensor([[prev, tokens[-1]]], dtype=I32),
                                torch.tensor([[position - 1, position]], dtype=I32), cache_mask(bucket, position - 1))
        self.stats.draft_passes += 1
        return proposals[0].tolist()

    def accepted(self, a: int, features, position: int) -> None:
        pass  # accepted proposals' K/V are already in the draft cache; the rest is re-fed next call


class DFlashDrafter:
    """One block pass proposes block_size-1 tokens from target features of accepted positions."""

    def __init__(self, run, buckets, k: int, block_size: int, feature_dim: int, dtype, stats: SpecStats):
        self.run, self.buckets, self.k, self.block, self.stats = run, buckets, k, block_size, stats
        self.feature_dim, self.dtype = feature_dim, dtype
        self.pending = None  # target features [r, F] of positions (position - r .. position - 1)

    def prefill(self, n_chunks_bucket, prompt_features: torch.Tensor) -> None:
        self.run("dflash_context", n_chunks_bucket, prompt_features)
        self.stats.draft_passes += 1

    def propose(self, tokens: list[int], position: int) -> list[int]:
        feats = self.pending
        r = 0 if feats is None else feats.shape[0]
        new = torch.zeros(1, self.block, self.feature_dim, dtype=self.dtype)
        if r:
            new[0, :r] = feats
        # padding rows go to slots >= position: not valid context yet, overwritten once accepted
        positions = (position - r + torch.arange(self.block, dtype=I32))[None]
        bucket = self.buckets.kv_bucket(position + self.block)
        (proposals,) = self.run("dflash_draft", bucket, new, positions, torch.tensor([[tokens[-1]]], dtype=I32),
                                torch.tensor([position], dtype=I32), cache_mask(bucket, position))
        self.stats.draft_passes += 1
        self.pending = None
        return proposals[0].tolist()

    def accepted(self, a: int, features, position: int) -> None:
        self.pending = features[0][0, : a + 1]


def ngram_propose(history: list[int], k: int, max_n: int = 3) -> list[int]:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the longest (<= max_n) suffix."""
    for n in range(min(max_n, len(history) - 1), 0, -1):
        suffix = history[-n:]
        for i in range(len(history) - n - 1, -1, -1):
            if history[i:i + n] == suffix:
                return history[i + n:i + n + k]
    return []


class NgramDrafter:
    def __init__(self, k: int, max_n: int = 3):
        self.k, self.max_n = k, max_n

    def propose(self, tokens: list[int], position: int) -> list[int]:
        return ngram_propose(tokens, self.k, self.max_n)

    def accepted(self, a: int, features, position: int) -> None:
        pass
