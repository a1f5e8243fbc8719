"""The drafts: fused-K layer draft, DFlash block draft, n-gram prompt lookup; and speculation statistics."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .generate import I32, Sequence, batch_slots, cache_masks, padded


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

    @classmethod
    def merged(cls, parts: list["SpecStats"]) -> "SpecStats":
        """The statistics of several sequences (the windows of one long file) as one."""
        out = cls(parts[0].draft_kind, parts[0].k, target_passes=0)
        for p in parts:
            out.target_passes += p.target_passes
            out.draft_passes += p.draft_passes
            out.verify_calls += p.verify_calls
            out.generated += p.generated
            out.steps += p.steps
        return out

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
    """The pruned-layer draft: its own prefill with the audio context into the sequence's slot, then K unrolled
    steps of every sequence per call."""

    def __init__(self, run, buckets, k: int):
        self.run, self.buckets, self.k = run, buckets, k

    def prefill(self, seq: Sequence, n_chunks_bucket, ids, audio, audio_positions) -> None:
        self.run("draft_context_encoding", n_chunks_bucket, ids, audio, audio_positions,
                 torch.tensor([seq.slot], dtype=I32))
        seq.stats.draft_passes += 1

    def propose(self, seqs: list[Sequence], free_slots: list[int]) -> list[list[int]]:
        slots = batch_slots(seqs, self.buckets, free_slots)
        b, last = len(slots), [s.position for s in seqs]
        bucket = self.buckets.kv_bucket(max(last) + self.k)
        (proposals,) = self.run(
            "draft_fused_k", bucket, torch.tensor(padded([[s.prev_token, s.tokens[-1]] for s in seqs], b, [0, 0]),
                                                  dtype=I32),
            torch.tensor(padded([[p - 1, p] for p in last], b, [0, 1]), dtype=I32),
            cache_masks(bucket, padded([p - 1 for p in last], b, 0)), slots)
        for s in seqs:
            s.stats.draft_passes += 1
        return proposals[:len(seqs)].tolist()

    def accepted(self, seq: Sequence, a: int, features) -> None:
        pass  # accepted proposals' K/V are already in the draft cache; the rest is re-fed next call


class DFlashDrafter:
    """One block pass per sequence proposes block_size-1 tokens from target features of accepted positions."""

    def __init__(self, run, buckets, k: int, block_size: int, feature_dim: int, dtype):
        self.run, self.buckets, self.k, self.block = run, buckets, k, block_size
        self.feature_dim, self.dtype = feature_dim, dtype

    def prefill(self, seq: Sequence, n_chunks_bucket, prompt_features: torch.Tensor) -> None:
        self.run("dflash_context", n_chunks_bucket, prompt_features, torch.tensor([seq.slot], dtype=I32))
        seq.stats.draft_passes += 1

    def propose(self, seqs: list[Sequence], free_slots: list[int]) -> list[list[int]]:
        slots = batch_slots(seqs, self.buckets, free_slots)
        b, last = len(slots), [s.position for s in seqs]
        new = torch.zeros(b, self.block, self.feature_dim, dtype=self.dtype)
        first = []  # the first new context row of each sequence: its pending rows end just before its position
        for i, s in enumerate(seqs):
            r = 0 if s.pending is None else s.pending.shape[0]
            if r:
                new[i, :r] = s.pending
            first.append(s.position - r)
            s.pending = None
            s.stats.draft_passes += 1
        # padding rows go to rows >= position: not valid context yet, overwritten once accepted
        positions = torch.tensor(padded(first, b, 0), dtype=I32)[:, None] + torch.arange(self.block, dtype=I32)
        bucket = self.buckets.kv_bucket(max(last) + self.block)
        (proposals,) = self.run("dflash_draft", bucket, new, positions,
                                torch.tensor(padded([[s.tokens[-1]] for s in seqs], b, [0]), dtype=I32),
                                torch.tensor(padded(last, b, 0), dtype=I32), cache_masks(bucket, padded(last, b, 0)),
                                slots)
        return proposals[:len(seqs)].tolist()

    def accepted(self, seq: Sequence, a: int, features) -> None:
        seq.pending = features[: a + 1].clone()  # not a view: a finished sequence would pin the whole verify output


def ngram_propose(history: list[int], k: int, max_n: int = 3) -> list[int]:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the longest (<= max_n) suffix."""
    for n in range(min(max_n, len(history) - 1), 0, -1):
        suffix = history[-n:]
        for i in range(len(history) - n - 1, -1, -1):
            if history[i:i + n] == suffix:
                return history[i + n:i + n + k]
    return []


class NgramDrafter:
    """Prompt lookup on the host, per sequence over its own emitted tokens."""

    def __init__(self, k: int, max_n: int = 3):
        self.k, self.max_n = k, max_n

    def propose(self, seqs: list[Sequence], free_slots: list[int]) -> list[list[int]]:
        return [ngram_propose(s.tokens, self.k, self.max_n) for s in seqs]

    def accepted(self, seq: Sequence, a: int, features) -> None:
        pass
