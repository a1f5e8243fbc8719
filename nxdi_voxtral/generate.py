"""Prefill and greedy decode loops over the graphs (gpt-fast style: each fits on a screen)."""
from __future__ import annotations

import torch

from .errors import ConfigError
from .graphs import Buckets

I32 = torch.int32


def prepare_prefill(input_ids: torch.Tensor, input_features: torch.Tensor, cfg, buckets: Buckets):
    """Host side of prefill: pad mel to the chunk bucket, ids to the prompt bucket, audio positions by index."""
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ConfigError(f"input_ids must be [1, T] (batch size 1), got shape {tuple(input_ids.shape)}")
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


def cache_mask(bucket: int, valid: int) -> torch.Tensor:
    return (torch.arange(bucket) < valid).to(I32)[None]


def decode(run, first_token: int, position: int, max_new_tokens: int, eos_id: int, buckets: Buckets,
           on_tokens=None) -> list[int]:
    """Plain greedy: one token_generation call per token. Stops at EOS (kept) or max_new_tokens.
    on_tokens(new_ids) is called with every token after the first as it is emitted (streaming)."""
    tokens = [first_token]
    while len(tokens) < max_new_tokens and tokens[-1] != eos_id:
        bucket = buckets.kv_bucket(position + 1)
        (nxt,) = run("token_generation", bucket, torch.tensor([[tokens[-1]]], dtype=I32),
                     torch.tensor([position], dtype=I32), cache_mask(bucket, position))
        tokens.append(int(nxt[0]))
        position += 1
        if on_tokens is not None:
            on_tokens(tokens[-1:])
    return tokens


def speculate(run, drafter, first_token: int, position: int, max_new_tokens: int, eos_id: int,
              buckets: Buckets, k: int, stats, on_tokens=None) -> list[int]:
    """Draft proposes up to k tokens, one target `verify` pass accepts the longest prefix that equals its own
    greedy choice and adds one token: output is plain greedy, token for token. Stops at EOS / max_new_tokens
    even inside an accepted block."""
    tokens = [first_token]
    while len(tokens) < max_new_tokens and tokens[-1] != eos_id:
        proposal = drafter.propose(tokens, position)
        if not proposal:  # nothing to verify (n-gram miss): a plain decode step is the cheaper target pass
            tokens += decode(run, tokens[-1], position, 2, eos_id, buckets, on_tokens)[1:]
            stats.record([], 0, 1)
            position += 1
            continue
        bucket = buckets.kv_bucket(position + k + 1)
        candidates = torch.tensor([[tokens[-1]] + proposal + [0] * (k - len(proposal))], dtype=I32)
        target, accepted, bonus, *features = run(
            "verify", bucket, candidates, (position + torch.arange(k + 1, dtype=I32))[None],
            cache_mask(bucket, position), torch.tensor([len(proposal)], dtype=I32))
        a = int(accepted[0])
        new = proposal[:a] + [int(bonus[0])]
        drafter.accepted(a, features, position)
        room = max_new_tokens - len(tokens)
        if eos_id in new:
            room = min(room, new.index(eos_id) + 1)
        tokens += new[:room]
        stats.record(proposal, a, len(new[:room]))
        position += a + 1
        if on_tokens is not None:
            on_tokens(new[:room])
    return tokens
