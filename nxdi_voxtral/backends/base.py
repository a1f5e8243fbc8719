"""What every backend is: one object with the same small interface (the registry is backends/__init__.py)."""
from __future__ import annotations

from pathlib import Path

from ..errors import ArtifactError, ConfigError
from ..ranks import open_ranks


class Backend:
    """A way to run the graphs of graph_plan. The application, the build and the manifest check call these methods
    and never branch on a backend's name.

    build_kwargs are build_engine's keyword arguments (model_dir, draft, draft_kind, k, dtype, buckets)."""

    name: str = ""
    summary: str = ""
    from_checkpoint: bool = False  # from_pretrained(backend=name) works (graphs prepared at load)
    builds: bool = True            # compile.build --backend name writes artifacts

    def unavailable(self) -> str | None:
        """Why this host cannot build or run this backend, or None."""
        return None

    def require(self, doing: str) -> None:
        """ArtifactError, before any weight is read, where this host cannot `doing` (build / load) with it."""
        why = self.unavailable()
        if why:
            raise ArtifactError(f"backend {self.name!r} cannot {doing} on this host: {why}")

    def open(self, build_kwargs: dict, tp: int, call_timeout_s: float | None = None):
        """From a checkpoint: load on tp ranks and prepare every graph -> (ranks, compile_stats or None)."""
        if not self.from_checkpoint:
            raise ConfigError(f"backend {self.name!r} runs from built artifacts: `python -m compile.build --backend "
                              f"{self.name} --out builds/NAME ...`, then from_artifacts(\"builds/NAME\")")
        return open_ranks(tp, build_kwargs, call_timeout_s), None

    def build(self, build_kwargs: dict, tp: int, out: Path, progress) -> tuple:
        """Check every graph's contract and write this backend's artifacts under out -> (GraphSetup, per-graph
        records for the manifest, extra manifest fields)."""
        raise ConfigError(f"backend {self.name!r} writes no artifacts")

    def load(self, art_dir: Path, manifest: dict, build_kwargs: dict, call_timeout_s: float | None = None):
        """From a verified artifact directory -> (ranks, compile_stats or None)."""
        raise ArtifactError(f"backend {self.name!r} has no artifacts to load")

    def check_host(self, manifest: dict, host: dict) -> None:
        """Refuse (ArtifactError) artifacts this host cannot run: its software stack differs from the build's."""
        if manifest["versions"]["torch"] != host["torch"]:
            raise ArtifactError(f"versions.torch: built with torch {manifest['versions']['torch']}, this host has "
                                f"{host['torch']} ({self.name} artifacts are tied to the torch version); rebuild "
                                f"with `python -m compile.build --backend {self.name}` on this stack")


def closing_on_error(ranks, fn):
    """fn(ranks); the ranks are closed if it fails (a half-prepared model leaves no rank process behind)."""
    try:
        return fn(ranks)
    except BaseException:
        ranks.close()
        raise
