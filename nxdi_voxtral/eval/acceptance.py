"""Offline acceptance (tau) of a draft, computed the way the DFlash card does: the target's greedy trace is
teacher-forced and the draft is anchored at every response position; accepted = matching prefix of its
proposals against the trace; tau = mean(accepted + 1).

python -m nxdi_voxtral.eval.acceptance --model DIR --draft DIR --draft-kind layers|dflash|ngram [-k K] AUDIO...
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
from tqdm import tqdm

from ..generate import I32, cache_masks


def target_features(m, trace: list[int], position: int, slot: int) -> torch.Tensor:
    """Teacher-forced target features [len(trace), F] of trace tokens at position.. (verify passes over the trace;
    the target cache slot must hold the prompt)."""
    k, rows = m.setup.k, []
    for i in range(0, len(trace), k + 1):
        chunk = trace[i:i + k + 1]
        bucket = m.buckets.kv_bucket(position + i + k + 1)
        cands = torch.tensor([chunk + [0] * (k + 1 - len(chunk))], dtype=I32)
        *_, feats = m.run("verify", bucket, cands, (position + i + torch.arange(k + 1, dtype=I32))[None],
                          cache_masks(bucket, [position + i]), torch.tensor([len(chunk) - 1], dtype=I32),
                          torch.tensor([slot], dtype=I32))
        rows.append(feats[0, :len(chunk)])
    return torch.cat(rows)


def teacher_forced(m, input_ids, input_features, max_new_tokens: int, progress: bool = False) -> dict:
    trace = m.generate(input_ids, input_features, max_new_tokens=max_new_tokens)[0].tolist()
    seq = m.start(input_ids, input_features, max_new_tokens, slot=0)
    assert seq.tokens == trace[:1]
    position = seq.position
    feats = target_features(m, trace, position, seq.slot) if m.draft_kind == "dflash" else None
    accepted = []
    for i in tqdm(range(len(trace) - 1), disable=not progress, desc="anchors", leave=False):
        seq.tokens, seq.position = trace[:i + 1], position + i  # anchored at trace position i
        if feats is not None and i > 0:
            m.drafter.accepted(seq, 0, feats[i - 1:i])
        proposal = m.drafter.propose([seq], [])[0]
        truth = trace[i + 1:i + 1 + len(proposal)]
        a = 0
        while a < len(truth) and proposal[a] == truth[a]:
            a += 1
        accepted.append(a)
    tau = sum(a + 1 for a in accepted) / len(accepted) if accepted else 0.0
    return {"tau": tau, "anchors": len(accepted), "accepted": accepted, "trace": trace}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nxdi_voxtral.eval.acceptance", description=__doc__.split("\n\n")[0])
    ap.add_argument("audio", nargs="+")
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft")
    ap.add_argument("--draft-kind", required=True, choices=["layers", "dflash", "ngram"])
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=None)
    ap.add_argument("--language", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from .. import NxDVoxtralSpecDec, VoxtralError
    try:
        m = NxDVoxtralSpecDec.from_pretrained(args.model, draft=args.draft, draft_kind=args.draft_kind,
                                              num_speculative_tokens=args.num_speculative_tokens)
        results = {}
        for path in tqdm(args.audio, desc="files", disable=args.json):
            p = m.prepare(path, language=args.language)
            r = teacher_forced(m, p.input_ids, p.input_features, args.max_new_tokens, progress=not args.json)
            results[path] = {"tau": r["tau"], "anchors": r["anchors"]}
    except VoxtralError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    anchors = sum(r["anchors"] for r in results.values())
    mean = sum(r["tau"] * r["anchors"] for r in results.values()) / anchors if anchors else 0.0
    if args.json:
        print(json.dumps({"files": results, "tau": mean, "k": m.setup.k}))
    else:
        for path, r in results.items():
            print(f"{path}\ttau={r['tau']:.3f}\tanchors={r['anchors']}")
        print(f"mean tau={mean:.3f} over {anchors} anchors (draft={args.draft_kind}, K={m.setup.k})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
