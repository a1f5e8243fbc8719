"""inductor: torch.compile(graph, fullgraph=True, dynamic=False) of every (tag, bucket) graph on CPU; the artifact
is torch's compile cache, one directory per rank (nxdi_voxtral/compiled.py). The TorchNeuron backend is the same
machinery with another compile target (torchneuron.py)."""
from __future__ import annotations

import logging
from pathlib import Path

from .. import compiled
from ..errors import ArtifactError
from ..ranks import open_ranks
from .base import Backend, closing_on_error

log = logging.getLogger(__name__)
COMPILE_CACHE = "compile_cache"  # compile_cache/rank{r}/: torch's compile caches of rank r


class TorchCompile(Backend):
    from_checkpoint = True
    target = compiled.INDUCTOR

    def open(self, build_kwargs, tp, call_timeout_s=None, cache_dir: str | None = None, building: bool = False):
        self.require("load")  # before any weight is read or a rank process starts
        ranks = open_ranks(tp, build_kwargs, call_timeout_s, self.target.process_group)
        # every rank compiles its own graphs; rank 0's records stand for all
        stats = closing_on_error(ranks, lambda r: r.call("compile", self.target, cache_dir, building)[0])
        return ranks, stats

    def build(self, build_kwargs, tp, out: Path, progress):
        ranks, graphs = self.open(build_kwargs, tp, cache_dir=str(out / COMPILE_CACHE), building=True)
        ranks.close()
        return ranks.setup, graphs, {"compile": {"torch_compile_backend": self.target.backend,
                                                 "device": self.target.device, "cache_dir": COMPILE_CACHE}}

    def load(self, art_dir, manifest, build_kwargs, call_timeout_s=None):
        ranks, stats = self.open(build_kwargs, manifest["tp"], call_timeout_s,
                                 cache_dir=str(art_dir / manifest["compile"]["cache_dir"]))
        s = compiled.summary(stats)
        log.info("compiled %d graphs in %.1f s (%d from the artifact's cache, %d recompiled)", s["graphs"],
                 s["seconds"], s["aot_cache_hits"], s["inductor_compiles"])
        if s["inductor_compiles"]:
            log.warning("%s: %d graph(s) missed the artifact's compile cache and were recompiled (another CPU or "
                        "compiler settings than the build host?)", art_dir, s["inductor_compiles"])
        return ranks, stats

    def check_host(self, manifest, host):
        super().check_host(manifest, host)
        built = manifest["compile"]["torch_compile_backend"]
        if built != self.target.backend:  # a schema-1 "compiled" build made on a TorchNeuron host
            raise ArtifactError(f"compile.torch_compile_backend: the cache was built for torch.compile backend "
                                f"{built!r}, backend {self.name!r} compiles with {self.target.backend!r}")


class Inductor(TorchCompile):
    name = "inductor"
    summary = "torch.compile with inductor (C++ kernels) on CPU; the artifact is the compile cache"


INDUCTOR = Inductor()
