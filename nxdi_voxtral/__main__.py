"""python -m nxdi_voxtral transcribe AUDIO [--model DIR] [--language en]"""
from __future__ import annotations

import argparse
import json
import logging
import sys

import torch

from .errors import VoxtralError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nxdi_voxtral")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("transcribe", help="transcribe an audio file (wav/flac/ogg/mp3)")
    t.add_argument("audio")
    t.add_argument("--model", help="Voxtral HF checkpoint dir; omitted: the embedded synthetic demo model")
    t.add_argument("--language", default=None, help="ISO-639-1 code, e.g. en (optional)")
    t.add_argument("--max-new-tokens", type=int, default=256)
    t.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    t.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from .application import NxDVoxtralSpecDec
    from .synthetic import demo_model_dir
    try:
        model_dir = args.model
        if model_dir is None:
            model_dir = demo_model_dir()
            print(f"[demo] no --model given: synthetic demo weights — transcript is meaningless ({model_dir})",
                  file=sys.stderr)
        m = NxDVoxtralSpecDec.from_pretrained(model_dir, dtype=DTYPES[args.dtype])
        r = m.transcribe(args.audio, language=args.language, max_new_tokens=args.max_new_tokens)
    except VoxtralError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"text": r.text, "token_ids": r.token_ids, "timings": r.timings}))
    else:
        print(r.text)
        print(", ".join(f"{k}={v:.4g}" for k, v in r.timings.items()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
