"""python -m nxdi_voxtral transcribe AUDIO [--model DIR] [--language en] | serve [--artifacts DIR | --model DIR]"""
from __future__ import annotations

import argparse
import json
import logging
import sys


from .application import MAX_AUDIO_S
from .errors import VoxtralError
from .graphs import DTYPE_NAMES as DTYPES



def check_cheap_args(args) -> None:
    from pathlib import Path
    from .errors import AudioError, ConfigError
    from .processing import check_language
    audio = Path(args.audio)
    if not audio.exists():
        raise AudioError(f"{audio}: no such audio file")
    if audio.is_dir():
        raise AudioError(f"{audio}: is a directory, not an audio file")
    check_language(args.language)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be a positive integer, got {args.max_new_tokens}")
    if args.max_batch_size < 1:
        raise ConfigError(f"--max-batch-size must be a positive integer, got {args.max_batch_size}")
    k = args.num_speculative_tokens
    if k is not None and k < 1:
        raise ConfigError(f"-k / --num-speculative-tokens must be a positive integer, got {k}")
    if k is not None and args.draft is None and args.draft_kind is None:
        raise ConfigError(f"-k / --num-speculative-tokens {k} needs a draft: give --draft-kind (layers, dflash, "
                          "ngram) and/or --draft")
    if args.draft is not None and args.draft_kind == "ngram":
        raise ConfigError(f"--draft-kind ngram uses no draft checkpoint, but --draft {args.draft} was given")


def demo_model() -> dict:
    import os
    from .errors import ConfigError
    from .synthetic import demo_dirs
    try:
        return demo_dirs()
    except OSError as e:
        where = os.environ.get("NXDI_VOXTRAL_CACHE", "~/.cache/nxdi_voxtral")
        raise ConfigError(f"cannot create the demo model cache {where} (set NXDI_VOXTRAL_CACHE to a writable "
                          f"directory): {e.strerror or e}: {e.filename or ''}") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nxdi_voxtral")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("transcribe", help="transcribe an audio file (wav/flac/ogg/mp3)")
    t.add_argument("audio")
    t.add_argument("--model", help="Voxtral HF checkpoint dir; omitted: the embedded synthetic demo model")
    t.add_argument("--language", default=None, help="ISO-639-1 code, e.g. en (optional)")
    t.add_argument("--max-new-tokens", type=int, default=256)
    t.add_argument("--draft", help="draft checkpoint dir (layer draft or DFlash); demo: the demo's own draft")
    t.add_argument("--draft-kind", choices=["layers", "dflash", "ngram"], default=None)
    t.add_argument("-k", "--num-speculative-tokens", type=int, default=None,
                   help="proposals per target pass (default: layers 4, dflash block_size-1, ngram 3)")
    t.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    t.add_argument("--json", action="store_true", help="print the result as JSON")
    t.add_argument("--strict", action="store_true", help="refuse a truncated audio file instead of warning")
    t.add_argument("--max-batch-size", type=int, default=1,
                   help="sequences decoded at once: the windows of long audio run as a batch (default 1)")
    t.add_argument("--max-audio-s", type=float, default=MAX_AUDIO_S,
                   help="longest audio accepted; audio longer than the largest audio bucket is transcribed in "
                        "windows cut at quiet points (default 3 h)")
    s = sub.add_parser("serve", help="OpenAI-compatible transcription server (see README, Serving)")
    from .serve.cli import add_arguments as add_serve_arguments
    add_serve_arguments(s)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.cmd == "serve":
        from .serve.cli import serve
        try:
            return serve(args)
        except VoxtralError as e:
            print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
            return 2

    from .application import NxDVoxtralSpecDec
    try:
        check_cheap_args(args)  # before the model loads: a typo must not cost a model load
        model_dir, draft = args.model, args.draft
        if draft is not None and args.draft_kind is None:
            args.draft_kind = "layers"
        if model_dir is None:
            demo = demo_model()
            model_dir = demo["target"]
            if draft is None and args.draft_kind in ("layers", "dflash"):
                draft = demo[args.draft_kind]
            print(f"[demo] no --model given: synthetic demo weights — transcript is meaningless ({model_dir})",
                  file=sys.stderr)
        m = NxDVoxtralSpecDec.from_pretrained(model_dir, draft=draft, draft_kind=args.draft_kind,
                                              num_speculative_tokens=args.num_speculative_tokens,
                                              dtype=DTYPES[args.dtype], max_batch_size=args.max_batch_size)
        r = m.transcribe(args.audio, language=args.language, max_new_tokens=args.max_new_tokens, strict=args.strict,
                         max_audio_s=args.max_audio_s)
    except VoxtralError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    stats = r.stats.summary()
    if args.json:
        segments = [{"start": g.start, "end": g.end, "text": g.text} for g in r.segments]
        print(json.dumps({"text": r.text, "token_ids": r.token_ids, "segments": segments, "timings": r.timings,
                          "stats": stats}))
    else:
        print(r.text)
        print("timings: " + ", ".join(f"{k}={v:.4g}" for k, v in r.timings.items()), file=sys.stderr)
        print("stats: " + ", ".join(f"{k}={v}" for k, v in stats.items()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
