"""The backend registry: the one place that knows which backends exist and what each is called.

`compile.build --backend NAME`, `from_pretrained(..., backend=NAME)` and the manifest's "backend" field use the
same names; everything else asks the backend object (backends/base.py) and never compares names.
"""
from __future__ import annotations

from ..errors import ArtifactError, ConfigError
from .base import Backend
from .eager import EAGER
from .export import EXPORT
from .inductor import INDUCTOR
from .nxd import NXD
from .torchneuron import TORCHNEURON

# build default order: the first available Trainium backend, else the CPU artifact backend
BACKENDS: dict[str, Backend] = {b.name: b for b in (EAGER, EXPORT, INDUCTOR, TORCHNEURON, NXD)}
BUILD_PREFERENCE = ("torchneuron", "nxd", "export")
BUILDERS = tuple(name for name, b in BACKENDS.items() if b.builds)  # the backends that write artifacts
# names manifests carried before the registry (schema 1 alike): they still load under the new name
RENAMED = {"cpu": "export", "compiled": "inductor", "neuron": "nxd"}


def get(name: str) -> Backend:
    if name in BACKENDS:
        return BACKENDS[name]
    hint = f" (renamed {RENAMED[name]!r})" if name in RENAMED else ""
    raise ConfigError(f"unknown backend {name!r}{hint}; known: {', '.join(BACKENDS)}")


def for_manifest(manifest: dict) -> Backend:
    name = manifest.get("backend")
    name = RENAMED.get(name, name)
    if name not in BUILDERS:
        raise ArtifactError(f"backend: {manifest.get('backend')!r} is not a backend that writes artifacts "
                            f"({', '.join(BUILDERS)}); rebuild with "
                            "`python -m compile.build --backend NAME ...`")
    return BACKENDS[name]


def default_build_backend() -> Backend:
    return next(BACKENDS[n] for n in BUILD_PREFERENCE if BACKENDS[n].unavailable() is None)


def check_host(manifest: dict, tp_degree: int | None = None) -> Backend:
    """The artifact's backend, after refusing (ArtifactError) a host whose stack or TP degree differs from the
    build's."""
    from ..manifest import host_versions
    backend = for_manifest(manifest)
    backend.check_host(manifest, host_versions())
    if tp_degree is not None and tp_degree != manifest["tp"]:
        raise ArtifactError(f"tp: artifacts were built for tp={manifest['tp']}, tp_degree={tp_degree} requested")
    return backend
