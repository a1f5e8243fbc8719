"""python -m compile.build --model DIR [--draft DIR --draft-kind layers|dflash|ngram -k K] --tp 4
       [--buckets audio=1,2,4,10:kv=512,1024,2048,4096,8192] [--dtype bf16] --out builds/NAME
       [--backend BACKEND] [--pack-weights]

Enumerates every graph x bucket (nxdi_voxtral.graphs.graph_plan, the one list), checks the graph contract and
builds each with the chosen backend (nxdi_voxtral.backends: export, inductor, torchneuron, nxd; default the first
available of backends.BUILD_PREFERENCE: torchneuron, nxd, export), then writes manifest.json.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch

from nxdi_voxtral import backends
from nxdi_voxtral.errors import ArtifactError, ConfigError, VoxtralError
from nxdi_voxtral.graphs import DTYPE_NAMES as DTYPES, Buckets, parse_buckets
from nxdi_voxtral.manifest import SCHEMA_VERSION, file_entries, host_versions, weight_files, write_manifest

# what a build may leave in --out (--force replaces only a directory that holds one of these)
BUILD_OUTPUTS = ("manifest.json", "graphs", "compile_cache", "model.pt")


def check_build_args(model, out: Path, tp) -> None:
    """Everything cheap, before any weight is loaded or any rank process starts."""
    from nxdi_voxtral.config import VoxtralConfig
    from nxdi_voxtral.tp import layout
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"--out {out}: exists and is not a directory")
    if out.exists() and any(out.iterdir()):
        raise ArtifactError(f"{out}: exists and is not empty; choose a new --out (or --force to replace a build)")
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"--tp must be a positive integer, got {tp!r}")
    cfg = VoxtralConfig.from_dir(model)
    layout(cfg.text, cfg.audio, tp, 0)  # a tp that does not divide the heads: refused before workers start


def clear_earlier_build(out: Path) -> None:
    """--force: remove an earlier build's output (complete, or a failed one's leftovers) and nothing else."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ArtifactError(f"--out {out}: exists and is not a directory; --force only replaces a build directory")
    if any(out.iterdir()) and not any((out / name).exists() for name in BUILD_OUTPUTS):
        raise ArtifactError(f"--out {out}: not a build output (none of {', '.join(BUILD_OUTPUTS)}); --force refuses "
                            "to delete it")
    shutil.rmtree(out)


def progress(msg: str) -> None:
    print(msg, flush=True)


def build(model, out, draft=None, draft_kind=None, k=None, tp=1, buckets=None, dtype=torch.float32,
          backend: str | None = None, pack_weights=False, progress=progress) -> dict:
    be = backends.get(backend) if backend else backends.default_build_backend()
    if not be.builds:
        raise ConfigError(f"backend {be.name!r} writes no artifacts; build with one of {', '.join(backends.BUILDERS)}")
    be.require("build")
    out = Path(out)
    check_build_args(model, out, tp)
    t0 = time.perf_counter()
    kwargs = dict(model_dir=model, draft=draft, draft_kind=draft_kind, k=k, dtype=dtype, buckets=buckets or Buckets())
    progress(f"building {model} (draft={draft_kind or 'none'}) for tp={tp}, backend={be.name}")
    setup, graphs, extra = be.build(kwargs, tp, out, progress)
    weights = {}
    for role, src in (("target", model), ("draft", draft if draft_kind in ("layers", "dflash") else None)):
        if src is None:
            continue
        files = weight_files(Path(src))
        if pack_weights:
            dest = out / "weights" / role
            dest.mkdir(parents=True)
            for f in files:
                shutil.copy2(f, dest / f.name)
            weights[role] = {"packed": True, "dir": f"weights/{role}", "files": file_entries(out, weight_files(dest))}
        else:
            weights[role] = {"packed": False, "dir": str(Path(src).resolve()),
                             "files": file_entries(out, [f.resolve() for f in files])}
    total = time.perf_counter() - t0
    manifest = {
        "schema_version": SCHEMA_VERSION, "backend": be.name, "tp": tp, "lnc": 1, "dtype": str(dtype),
        **setup.to_manifest(), "config": setup.cfg.to_dict(),
        "versions": {**host_versions(), "nxdi_voxtral": "0.1.0"},
        "weights": weights, "graphs": graphs, "build_seconds": total, **extra,
    }
    write_manifest(out, manifest)
    progress(f"\n{'graph':<24} {'bucket':>6} {'batch':>5}  {'seconds':>7}")
    for g in graphs:
        progress(f"{g['tag']:<24} {g['bucket']:>6} {g['batch']:>5}  " + (f"{g['seconds']:7.2f}" if "seconds" in g else "      -"))
    progress(f"{len(graphs)} graphs x {tp} rank(s) in {total:.1f} s -> {out}")
    return manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m compile.build", description=__doc__.split("\n\n")[1])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft")
    ap.add_argument("--draft-kind", choices=["layers", "dflash", "ngram"])
    ap.add_argument("-k", "--num-speculative-tokens", type=int)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--buckets")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", help=f"one of {', '.join(backends.BUILDERS)} "
                    "(default: the first available of " + ", ".join(backends.BUILD_PREFERENCE) + ")")
    ap.add_argument("--pack-weights", action="store_true", help="copy the checkpoint(s) into the artifact")
    ap.add_argument("--force", action="store_true", help="replace --out if it holds an earlier (or failed) build")
    a = ap.parse_args(argv)
    out = Path(a.out)
    fresh = not out.exists() or (out.is_dir() and not any(out.iterdir()))
    try:
        buckets = parse_buckets(a.buckets)
        if a.force:
            clear_earlier_build(out)
            fresh = True
        build(a.model, out, a.draft, a.draft_kind, a.num_speculative_tokens, a.tp, buckets, DTYPES[a.dtype],
              a.backend, a.pack_weights)
    except BaseException as e:
        if fresh and out.is_dir() and not (out / "manifest.json").is_file():
            shutil.rmtree(out, ignore_errors=True)  # a failed build leaves nothing that blocks the retry
        if not isinstance(e, VoxtralError):
            raise
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
