"""python -m compile.build --model DIR [--draft DIR --draft-kind layers|dflash|ngram -k K] --tp 4
       [--buckets audio=1,2,4,10:kv=512,1024,2048,4096,8192] [--dtype bf16] --out artifacts/NAME
       [--backend neuron|cpu|compiled] [--pack-weights]

Enumerates every graph x bucket (nxdi_voxtral.graphs.graph_plan, the one list), checks the graph contract and
compiles each: backend `cpu` exports torch programs (one per graph, bucket and rank); backend `neuron` hands the
same modules to NxD's ModelBuilder (needs the Neuron SDK, see nxdi_voxtral/neuron.py); backend `compiled` runs
torch.compile on every graph and rank and keeps the compile caches (inductor's on CPU, TorchNeuron's NEFF cache
on a Neuron host; see nxdi_voxtral/compiled.py). Writes manifest.json.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch

from nxdi_voxtral.errors import ArtifactError, ConfigError, VoxtralError
from nxdi_voxtral.graphs import Buckets
from nxdi_voxtral.manifest import SCHEMA_VERSION, file_entries, host_versions, weight_files, write_manifest

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COMPILE_CACHE = "compile_cache"  # backend compiled: torch's compile caches, compile_cache/rank{r}/


BUCKET_KEYS = {"audio": "audio_chunks", "kv": "kv_lengths"}


def parse_buckets(text: str | None) -> Buckets:
    """'audio=1,2:kv=512,1024' -> Buckets; a ConfigError names the part that is wrong."""
    if not text:
        return Buckets()
    example = "expected e.g. audio=1,2,4:kv=512,1024"
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
    if any(out.iterdir()) and not ((out / "manifest.json").is_file() or (out / "graphs").is_dir()
                                   or (out / COMPILE_CACHE).is_dir()):
        raise ArtifactError(f"--out {out}: not a build output (no manifest.json, graphs/ or {COMPILE_CACHE}/); "
                            "--force refuses to delete it")
    shutil.rmtree(out)


def progress(msg: str) -> None:
    print(msg, flush=True)


def default_backend() -> str:
    try:
        import neuronx_distributed  # noqa: F401
        return "neuron"
    except ImportError:
        return "cpu"


def build(model, out, draft=None, draft_kind=None, k=None, tp=1, buckets=None, dtype=torch.float32,
          backend=None, pack_weights=False) -> dict:
    from nxdi_voxtral.engine import build_engine
    from nxdi_voxtral.workers import RankWorkers
    backend = backend or default_backend()
    out = Path(out)
    check_build_args(model, out, tp)
    t0 = time.perf_counter()
    kwargs = dict(model_dir=model, draft=draft, draft_kind=draft_kind, k=k, dtype=dtype, buckets=buckets or Buckets())
    print(f"building {model} (draft={draft_kind or 'none'}) for tp={tp}, backend={backend}", flush=True)
    lnc, compiled = 1, None
    if backend == "neuron":
        from nxdi_voxtral.graphs import graph_plan
        from nxdi_voxtral.neuron import LNC, compile_neuron
        engine = build_engine(**kwargs)  # CPU, tp 1: the graph setup, the draft's sharing, the contract check
        for spec in graph_plan(engine.setup):
            engine.check_contract(spec)
        out.mkdir(parents=True, exist_ok=True)
        setup, graphs, lnc = engine.setup, compile_neuron(engine, model, draft, out, tp, progress), LNC
        del engine
    elif backend == "compiled":  # the artifact is torch's compile cache, one directory per rank
        from nxdi_voxtral.compiled import compile_target
        target = compile_target()
        cache = str(out / COMPILE_CACHE)
        if tp == 1:
            engine = build_engine(**kwargs)
            setup, graphs = engine.setup, engine.compile(cache, True)
        else:
            workers = RankWorkers(tp, {**kwargs, "process_group": target.process_group})
            try:
                setup, graphs = workers.setup, workers.call("compile", cache, True)[0]
            finally:
                workers.close()
        compiled = {"torch_compile_backend": target.backend, "device": target.device, "cache_dir": COMPILE_CACHE}
    elif tp == 1:
        (out / "graphs").mkdir(parents=True)
        engine = build_engine(**kwargs)
        setup, graphs = engine.setup, engine.export(str(out / "graphs"), rank=0)
    else:
        (out / "graphs").mkdir(parents=True)
        workers = RankWorkers(tp, kwargs)
        try:
            setup, graphs = workers.setup, workers.call("export", str(out / "graphs"))[0]
        finally:
            workers.close()
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
        "schema_version": SCHEMA_VERSION, "backend": backend, "tp": tp, "lnc": lnc, "dtype": str(dtype),
        "draft_kind": setup.draft_kind, "k": setup.k,
        "graph_setup": {"capture_layers": list(setup.capture_layers), "dflash_block": setup.dflash_block,
                        "draft_own_audio": setup.draft_own_audio},
        "buckets": {"audio_chunks": list(setup.buckets.audio_chunks), "kv_lengths": list(setup.buckets.kv_lengths),
                    "text_slack": setup.buckets.text_slack},
        "config": setup.cfg.to_dict(), "versions": {**host_versions(), "nxdi_voxtral": "0.1.0"},
        "weights": weights, "graphs": graphs, "build_seconds": total,
    }
    if compiled:
        manifest["compile"] = compiled
    write_manifest(out, manifest)
    print(f"\n{'graph':<24} {'bucket':>6}  {'seconds':>7}")
    for g in graphs:
        print(f"{g['tag']:<24} {g['bucket']:>6}  " + (f"{g['seconds']:7.2f}" if "seconds" in g else "      -"))
    print(f"{len(graphs)} graphs x {tp} rank(s) in {total:.1f} s -> {out}")
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
    ap.add_argument("--backend", choices=["neuron", "cpu", "compiled"])
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
