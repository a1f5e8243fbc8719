"""torchneuron: torch.compile(graph, backend="neuron") of every (tag, bucket) graph — Dynamo -> AOTAutograd ->
TorchNeuron's FX passes -> torch-mlir -> StableHLO -> neuronx-cc -> one NEFF per graph and input signature. The
supported Trainium stack from Neuron SDK 2.34 (Trn2, Trn3). The artifact is torch's MegaCache per rank
(torch.compiler.save_cache_artifacts(), which TorchNeuron extends with its NEFFs); the manifest records which NEFF
cache keys each graph compiled to, and a load whose graph compiles to any other key is refused naming the graph.

Rehearsed on CPU through the real backend source up to the compiler boundary (../shared/torchneuron-rehearsal,
tests/rehearsal_torchneuron); nothing here has run on a Neuron device (docs/neuron.md, "Verified where")."""
from __future__ import annotations

from .. import compiled
from ..errors import ArtifactError
from ..graphs import GraphSpec
from .inductor import TorchCompile

SUPPORTED = "Neuron SDK >= 2.34 (torch-neuronx registering the torch.compile backend 'neuron'), Trn2 / Trn3"


class TorchNeuron(TorchCompile):
    name = "torchneuron"
    summary = "torch.compile(backend='neuron') -> NEFFs, one per graph and signature (" + SUPPORTED + ")"

    @property
    def target(self):
        return compiled.torchneuron_target()

    def unavailable(self):
        if not compiled.neuron_backend_registered():
            return f"the torch.compile backend 'neuron' is not registered here; needs {SUPPORTED}"
        return None

    def load(self, art_dir, manifest, build_kwargs, call_timeout_s=None):
        ranks, stats = super().load(art_dir, manifest, build_kwargs, call_timeout_s)
        built = {(g["tag"], g["bucket"], g["batch"]): set(g.get("neff_keys", ())) for g in manifest["graphs"]}
        for r in stats:  # rank 0's graphs: a key the release does not hold was compiled here, not loaded
            missed = sorted(set(r.get("neff_keys", ())) - built[(r["tag"], r["bucket"], r["batch"])])
            if missed:
                ranks.close()
                raise ArtifactError(f"{GraphSpec(r['tag'], r['bucket'], r['batch']).name}: compiled to NEFF cache key {missed[0][:16]}..., "
                                    f"which {art_dir} does not hold (another compiler, flags or torch than the "
                                    f"build's?); rebuild with `python -m compile.build --backend torchneuron`")
        return ranks, stats

    def check_host(self, manifest, host):
        super().check_host(manifest, host)
        built = manifest["versions"].get("neuron", {})
        for name in ("torch_neuronx", "neuronxcc"):
            if built.get(name) != host["neuron"].get(name):
                raise ArtifactError(f"versions.neuron.{name}: built with {built.get(name)}, this host has "
                                    f"{host['neuron'].get(name)} (NEFFs are tied to the compiler); rebuild with "
                                    "`python -m compile.build --backend torchneuron` on this stack")


TORCHNEURON = TorchNeuron()
