"""export: one torch.export program per (tag, bucket, rank), weights and KV caches passed in (nxdi_voxtral/export.py).
"""
from __future__ import annotations

from pathlib import Path

from ..ranks import open_ranks
from .base import Backend, closing_on_error

GRAPHS_DIR = "graphs"


class Export(Backend):
    name = "export"
    summary = "torch.export programs, one per graph, bucket and rank (CPU)"

    def build(self, build_kwargs, tp, out: Path, progress):
        (out / GRAPHS_DIR).mkdir(parents=True)
        ranks = open_ranks(tp, build_kwargs)
        try:
            return ranks.setup, ranks.call("export", str(out / GRAPHS_DIR))[0], {}
        finally:
            ranks.close()

    def load(self, art_dir, manifest, build_kwargs, call_timeout_s=None):
        ranks = open_ranks(manifest["tp"], build_kwargs, call_timeout_s)
        closing_on_error(ranks, lambda r: r.call("load_programs", str(art_dir / GRAPHS_DIR), manifest["graphs"]))
        return ranks, None


EXPORT = Export()
