"""Where two greedy token streams part, and whether it was a near-tie.

For streams a and b (e.g. ours in bf16 and transformers in bf16, or plain and speculative): the first index
where they differ, the top-2 logit margin of reference logits there (teacher-forced on the common prefix,
e.g. fp32), and the bf16 ulp at that logit's magnitude. A margin of a few ulps is a near-tie: two bf16
implementations that round differently may pick either token, and neither is wrong.

    python -m nxdi_voxtral.eval.divergence AUDIO [--model DIR] [--max-new-tokens N]
compares our bf16 greedy with transformers' bf16 greedy on the same weights, margins from our fp32 logits.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass

import torch


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First index where the streams differ; a stream that ended early differs at its length. None: identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def bf16_ulp(x: float) -> float:
    """Spacing of bfloat16 numbers at |x| (8 significant bits): 2^(floor(log2|x|) - 7)."""
    x = abs(x)
    if x < 2.0 ** -126:  # subnormal range: a fixed spacing
        return 2.0 ** -133
    return 2.0 ** (math.floor(math.log2(x)) - 7)


@dataclass(frozen=True)
class Divergence:
    index: int | None          # first differing position (None: identical)
    a: int | None              # the tokens there (None where a stream had ended)
    b: int | None
    top1: float | None         # reference logit of the best token there
    margin: float | None       # top-1 minus top-2 reference logit
    ulp: float | None          # bf16 ulp at |top1|

    @property
    def margin_ulps(self) -> float | None:
        return None if self.margin is None else self.margin / self.ulp

    def near_tie(self, max_ulps: float) -> bool:
        """True when the streams agree, or part where the reference's top two are within max_ulps bf16 ulps."""
        return self.index is None or (self.margin is not None and self.margin_ulps <= max_ulps)


def report(a: list[int], b: list[int], logits: torch.Tensor | None) -> Divergence:
    """logits [n, V]: reference logits teacher-forced along the common prefix (row i predicts token i); only the
    row at the divergence is read, so n may stop there."""
    i = first_divergence(a, b)
    if i is None:
        return Divergence(None, None, None, None, None, None)
    at = lambda s: s[i] if i < len(s) else None  # noqa: E731
    if logits is None or i >= logits.shape[0]:
        return Divergence(i, at(a), at(b), None, None, None)
    top = torch.topk(logits[i].float(), 2).values
    top1, margin = float(top[0]), float(top[0] - top[1])
    return Divergence(i, at(a), at(b), top1, margin, bf16_ulp(top1))


# ---------------------------------------------------------------- teacher-forced logits

@torch.no_grad()
def ours_logits(m, prompt, tokens: list[int]) -> torch.Tensor:
    """Our logits [len(tokens), V] (tp 1) predicting tokens[i] from prompt + tokens[:i]: one causal pass."""
    from ..model import causal_visible
    model = m.model
    ids = torch.cat([prompt.input_ids, torch.tensor([tokens[:-1]], dtype=prompt.input_ids.dtype)], dim=1)
    audio_pos = (prompt.input_ids[0] == model.cfg.audio_token_id).nonzero().flatten()
    x = model.embed_with_audio(ids, model.encode_audio(prompt.input_features.to(model.lm_head.weight.dtype)),
                               audio_pos)
    t = x.shape[1]
    h, _ = model.language_model(x, torch.arange(t)[None], torch.zeros(1, dtype=torch.int32), None,
                                causal_visible(t, x.device))
    return model.lm_head(h[0, prompt.input_ids.shape[1] - 1:]).float()


@torch.no_grad()
def hf_greedy(hf, prompt, max_new_tokens: int) -> list[int]:
    dtype = next(hf.parameters()).dtype
    out = hf.generate(input_ids=prompt.input_ids, input_features=prompt.input_features.to(dtype),
                      max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, prompt.input_ids.shape[1]:].tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nxdi_voxtral.eval.divergence", description=__doc__.split("\n\n")[0])
    ap.add_argument("audio", nargs="+")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded demo model)")
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--language", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from transformers import VoxtralForConditionalGeneration

    from .. import NxDVoxtralSpecDec, VoxtralError
    from ..synthetic import demo_dirs
    model_dir = args.model or demo_dirs()["target"]
    try:
        ours = NxDVoxtralSpecDec.from_pretrained(model_dir, dtype=torch.bfloat16)
        ref32 = NxDVoxtralSpecDec.from_pretrained(model_dir, dtype=torch.float32)
        hf = VoxtralForConditionalGeneration.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        rows = {}
        for path in args.audio:
            p = ours.prepare(path, language=args.language)
            a = ours.generate(p.input_ids, p.input_features, max_new_tokens=args.max_new_tokens)[0].tolist()
            b = hf_greedy(hf, p, args.max_new_tokens)
            i = first_divergence(a, b)
            d = report(a, b, None if i is None else ours_logits(ref32, p, a[:i + 1]))
            rows[path] = {**asdict(d), "margin_ulps": d.margin_ulps, "tokens": len(a)}
    except VoxtralError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows))
        return 0
    for path, r in rows.items():
        if r["index"] is None:
            print(f"{path}\tidentical over {r['tokens']} tokens")
        else:
            print(f"{path}\tfirst divergence at token {r['index']}: ours {r['a']} vs transformers {r['b']}; "
                  f"fp32 top-2 margin {r['margin']:.3g} = {r['margin_ulps']:.2f} bf16 ulp at |logit| {r['top1']:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
