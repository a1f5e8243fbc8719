"""Artifact manifests: what was built, from which weights, for which host; every file with size and sha256.
Whether this host can run an artifact is its backend's call (backends.check_host)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .checkpoint import sha256_file
from .errors import ArtifactError

SCHEMA_VERSION = 2  # 2: decode-side graphs per batch bucket, every graph takes its rows' KV slots
MANIFEST = "manifest.json"




def file_entries(root: Path, paths) -> list[dict]:
    return [{"path": str(p.relative_to(root)) if p.is_relative_to(root) else str(p), "size": p.stat().st_size,
             "sha256": sha256_file(p)} for p in sorted(paths)]


def weight_files(model_dir: Path) -> list[Path]:
    names = ("config.json", "tekken.json", "model.safetensors.index.json")
    return sorted([p for p in model_dir.iterdir() if p.name in names or p.suffix == ".safetensors"])


def neuron_versions() -> dict:
    """Versions of the Neuron stack on this host (None where a package is absent)."""
    out = {}
    for name in ("torch_neuronx", "neuronxcc", "neuronx_distributed", "neuronx_distributed_inference", "nki"):
        try:
            mod = __import__(name)
            out[name] = str(getattr(mod, "__version__", "unknown"))
        except ImportError:
            out[name] = None
    return out


def host_versions() -> dict:
    import transformers
    from .kernels.ops import kernel_impl
    neuron = neuron_versions()  # torch-neuronx, neuronx-cc, NxD, NxDI, nki (None where absent)
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "neuron_sdk": neuron["torch_neuronx"], "neuron": neuron, "kernels": kernel_impl()}


def write_manifest(out: Path, manifest: dict) -> None:
    files = [p for p in out.rglob("*") if p.is_file() and p.name != MANIFEST]
    manifest["files"] = file_entries(out, files)
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, out / MANIFEST)


def _check_entries(entries, field: str, path: Path) -> list[dict]:
    if not isinstance(entries, list):
        raise ArtifactError(f"{path}: field {field} is missing or not a list")
    for i, e in enumerate(entries):
        if not (isinstance(e, dict) and isinstance(e.get("path"), str) and isinstance(e.get("size"), int)
                and isinstance(e.get("sha256"), str)):
            raise ArtifactError(f"{path}: {field}[{i}] must be an object with path, size and sha256")
    return entries


def verify(art_dir: str | Path, deep: bool = True, exact: bool = False) -> dict:
    """Manifest present and readable; every listed file present with its size (and sha256 when deep); external
    weights unchanged; exact: no file the manifest does not list. Raises ArtifactError naming the file or field."""
    root = Path(art_dir)
    path = root / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{root}: no {MANIFEST} (not an nxdi_voxtral artifact, or an unfinished build)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path}: corrupted ({e})") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{path}: corrupted (expected a JSON object, got {type(manifest).__name__})")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise ArtifactError(f"{path}: schema_version {manifest.get('schema_version')!r}, this nxdi_voxtral reads "
                            f"{SCHEMA_VERSION}; rebuild it with this version (`python -m compile.build`)")
    listed = list(_check_entries(manifest.get("files"), "files", path))
    weights = manifest.get("weights", {})
    if not isinstance(weights, dict):
        raise ArtifactError(f"{path}: field weights is not an object")
    for w in ("target", "draft"):
        if weights.get(w) and not weights[w].get("packed", True):
            listed += _check_entries(weights[w].get("files"), f"weights.{w}.files", path)
    if exact:
        known = {os.path.normpath(e["path"]) for e in manifest["files"]} | {MANIFEST}
        extra = sorted(str(p.relative_to(root)) for p in root.rglob("*")
                       if not p.is_dir() and str(p.relative_to(root)) not in known)
        if extra:
            raise ArtifactError(f"{root}: {len(extra)} file(s) the manifest does not list, first: {extra[0]}")
    for entry in listed:
        p = Path(entry["path"]) if os.path.isabs(entry["path"]) else root / entry["path"]
        if not p.is_file():
            raise ArtifactError(f"missing file {entry['path']}")
        if p.stat().st_size != entry["size"]:
            raise ArtifactError(f"file {entry['path']} is {p.stat().st_size} bytes, manifest says {entry['size']} "
                                f"(truncated or replaced)")
        if deep and sha256_file(p) != entry["sha256"]:
            raise ArtifactError(f"file {entry['path']}: sha256 mismatch (corrupted or modified)")
    return manifest
