"""The host loop over the graphs (gpt-fast style): prefill one sequence into its KV slot, then steps that advance
every active sequence at once, plain greedy or speculative. Each fits on a screen.

On CPU a sequence's tokens never depend on its batch-mates: every graph computes each row on its own
(row-invariant kernels, no cross-row reduction anywhere), each sequence reads only its own KV slot, and padding
rows of a batch bucket write into free slots, which a later prefill overwrites before anything reads them. On a
device the graphs are the same, but whether its kernels give a row the same bits at every batch bucket is
unverified (docs/neuron.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import ConfigError
from .graphs import Buckets

I32 = torch.int32


def prepare_prefill(input_ids: torch.Tensor, input_features: torch.Tensor, cfg, buckets: Buckets):
    """Host side of prefill: pad mel to the chunk bucket, ids to the prompt bucket, audio positions by index."""
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ConfigError(f"input_ids must be [1, T] (one prompt; pass a list for a batch), got shape "
                          f"{tuple(input_ids.shape)}")
    a = cfg.audio
    if input_features.dim() == 2:
        input_features = input_features[None]
    if input_features.dim() != 3 or tuple(input_features.shape[1:]) != (a.num_mel_bins, a.mel_frames_per_chunk):
        raise ConfigError(f"input_features must be [n_chunks, {a.num_mel_bins}, {a.mel_frames_per_chunk}], "
                          f"got shape {tuple(input_features.shape)}")
    n_chunks = input_features.shape[0]
    nb = buckets.chunk_bucket(n_chunks, cfg)
    t = input_ids.shape[1]
    p = buckets.prompt_length(nb, cfg)
    if t > p:
        raise ConfigError(f"prompt of {t} tokens does not fit the {p}-token prompt bucket for {nb} chunks")
    audio_pos = (input_ids[0] == cfg.audio_token_id).nonzero().flatten()  # host side; never inside a graph
    if audio_pos.numel() != n_chunks * a.tokens_per_chunk:
        raise ConfigError(f"prompt has {audio_pos.numel()} audio tokens but the features give "
                          f"{n_chunks * a.tokens_per_chunk} ({n_chunks} chunks x {a.tokens_per_chunk})")
    mel = torch.zeros(nb, a.num_mel_bins, a.mel_frames_per_chunk)
    mel[:n_chunks] = input_features
    ids = torch.zeros(1, p, dtype=I32)
    ids[0, :t] = input_ids[0].to(I32)
    positions = torch.full((nb * a.tokens_per_chunk,), p, dtype=I32)
    positions[: audio_pos.numel()] = audio_pos.to(I32)
    return nb, mel, ids, positions, torch.tensor([t - 1], dtype=I32)


def cache_masks(bucket: int, valid: list[int]) -> torch.Tensor:
    """[b, bucket] int32: row i marks the first valid[i] rows of sequence i's slot."""
    return (torch.arange(bucket)[None, :] < torch.tensor(valid)[:, None]).to(I32)


@dataclass(eq=False)
class Sequence:
    """One request being generated: its KV slot, the tokens emitted so far and where the next one goes."""
    slot: int
    tokens: list[int]          # emitted so far; the first is prefill's
    position: int              # the cache row of tokens[-1], which the next target pass writes
    max_new_tokens: int
    eos_id: int
    stats: object              # speculative.SpecStats
    prompt_last_token: int     # the layer draft re-feeds the token before tokens[-1]
    on_tokens: Callable | None = None
    pending: torch.Tensor | None = None   # DFlash: target features of accepted rows not yet in its context
    index: int = 0             # where its result goes in a batch call

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_new_tokens or self.tokens[-1] == self.eos_id

    @property
    def prev_token(self) -> int:
        return self.tokens[-2] if len(self.tokens) > 1 else self.prompt_last_token

    def emit(self, new: list[int]) -> list[int]:
        """Append new tokens, cut at EOS (kept) and max_new_tokens -> the tokens emitted. on_tokens(new) streams
        them; an exception it raises stops generation."""
        room = self.max_new_tokens - len(self.tokens)
        if self.eos_id in new:
            room = min(room, new.index(self.eos_id) + 1)
        new = new[:max(room, 0)]
        self.tokens += new
        if self.on_tokens is not None and new:
            self.on_tokens(new)
        return new


def padded(rows: list, b: int, filler) -> list:
    """rows, then filler for the padding rows up to the batch bucket b."""
    return rows + [filler] * (b - len(rows))


def batch_slots(seqs: list[Sequence], buckets: Buckets, free_slots: list[int]) -> torch.Tensor:
    """[b] int32 KV slots of one call at the batch bucket b of len(seqs): the sequences' own, then a distinct free
    slot per padding row (there are always enough: b <= the slot count)."""
    b = buckets.batch_bucket(len(seqs))
    return torch.tensor([s.slot for s in seqs] + free_slots[:b - len(seqs)], dtype=I32)


def decode_step(run, seqs: list[Sequence], buckets: Buckets, free_slots: list[int]) -> None:
    """Plain greedy: one token_generation call gives every sequence its next token."""
    slots = batch_slots(seqs, buckets, free_slots)
    b, last = len(slots), [s.position for s in seqs]
    bucket = buckets.kv_bucket(max(last) + 1)
    (nxt,) = run("token_generation", bucket, torch.tensor(padded([[s.tokens[-1]] for s in seqs], b, [0]), dtype=I32),
                 torch.tensor(padded(last, b, 0), dtype=I32), cache_masks(bucket, padded(last, b, 0)), slots)
    for s, token in zip(seqs, nxt.tolist()):
        s.position += 1
        s.emit([token])
        s.stats.record([], 0, 1)


def speculate_step(run, drafter, seqs: list[Sequence], buckets: Buckets, k: int, free_slots: list[int]) -> None:
    """Each sequence's draft proposes up to k tokens; one verify pass over all of them accepts, per sequence, the
    longest prefix that equals the target's own greedy choice and adds one token: every sequence's output is its
    plain greedy output, token for token. A sequence stops at EOS / max_new_tokens even inside an accepted block."""
    proposals = drafter.propose(seqs, free_slots)
    if not any(proposals):  # nothing to verify (n-gram misses): a plain step is the cheaper target pass
        return decode_step(run, seqs, buckets, free_slots)
    slots = batch_slots(seqs, buckets, free_slots)
    b, last = len(slots), [s.position for s in seqs]
    bucket = buckets.kv_bucket(max(last) + k + 1)
    candidates = [[s.tokens[-1]] + p + [0] * (k - len(p)) for s, p in zip(seqs, proposals)]
    target, accepted, bonus, *features = run(
        "verify", bucket, torch.tensor(padded(candidates, b, [0] * (k + 1)), dtype=I32),
        torch.tensor(padded([[p + j for j in range(k + 1)] for p in last], b, list(range(k + 1))), dtype=I32),
        cache_masks(bucket, padded(last, b, 0)), torch.tensor(padded([len(p) for p in proposals], b, 0), dtype=I32),
        slots)
    for i, (s, proposal) in enumerate(zip(seqs, proposals)):
        a = int(accepted[i])
        new = s.emit(proposal[:a] + [int(bonus[i])])
        drafter.accepted(s, a, features[0][i] if features else None)
        s.stats.record(proposal, a, len(new))
        s.position += a + 1


@dataclass
class Batch:
    """The active sequences of one model and its free KV slots. `step` advances every active sequence by one
    target pass (join and leave happen between steps: continuous batching)."""
    buckets: Buckets
    active: list[Sequence] = field(default_factory=list)
    free: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.free = list(range(self.buckets.max_batch))

    def take_slot(self) -> int:
        return self.free.pop(0)

    def release(self, seq: Sequence) -> None:
        """The sequence leaves (finished or cancelled); its slot is free from the next step."""
        self.active.remove(seq)
        self.free = sorted(self.free + [seq.slot])  # padding rows take the lowest: deterministic

    def step(self, run, drafter=None, k: int = 0) -> list[Sequence]:
        """One step of every active sequence -> the sequences that finished (their slots released)."""
        if drafter is None:
            decode_step(run, self.active, self.buckets, self.free)
        else:
            speculate_step(run, drafter, self.active, self.buckets, k, self.free)
        finished = [s for s in self.active if s.done]
        for s in finished:
            self.release(s)
        return finished
