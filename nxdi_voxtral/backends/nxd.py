"""nxd: NxD Core's ModelBuilder traces every (tag, bucket) graph and hands it to neuronx-cc (nxdi_voxtral/neuron.py).
For fleets pinned to Neuron SDK <= 2.33 and for Trn1 / Inf2: from SDK 2.34 AWS no longer supports NxD Inference,
ModelBuilder or PyTorch/XLA inference on Trn2 / Trn3 (use the torchneuron backend there)."""
from __future__ import annotations

from ..errors import ArtifactError
from ..neuron import SUPPORTED
from ..ranks import LocalRank
from .base import Backend


class NxD(Backend):
    name = "nxd"
    summary = "NxD ModelBuilder -> NEFFs (" + SUPPORTED + ")"

    def unavailable(self):
        try:
            import neuronx_distributed.trace.model_builder  # noqa: F401
        except ImportError as e:
            return f"needs neuronx-distributed and torch-neuronx 2.9 from AWS's Neuron repository ({e}); {SUPPORTED}"
        return None

    def build(self, build_kwargs, tp, out, progress):
        from ..neuron import LNC, compile_neuron
        rank = LocalRank(build_kwargs)  # CPU, tp 1: the graph setup, the draft's sharing, the contract check
        rank.engine.check_contracts()
        out.mkdir(parents=True, exist_ok=True)
        graphs = compile_neuron(rank.engine, build_kwargs["model_dir"], build_kwargs["draft"], out, tp, progress)
        return rank.setup, graphs, {"lnc": LNC}

    def load(self, art_dir, manifest, build_kwargs, call_timeout_s=None):
        from ..neuron import NeuronRanks
        return NeuronRanks(art_dir, manifest, build_kwargs), None

    def check_host(self, manifest, host):
        if host["neuron"]["torch_neuronx"] is None:
            raise ArtifactError(f"backend: artifacts are NEFFs for Neuron (nxd), this host has no Neuron SDK; "
                                f"{SUPPORTED}")
        for name, built in manifest["versions"].get("neuron", {}).items():  # NEFFs + model.pt: tied to the stack
            if name != "nki" and built != host["neuron"].get(name):
                raise ArtifactError(f"versions.neuron.{name}: built with {built}, this host has "
                                    f"{host['neuron'].get(name)}; rebuild the artifacts on this SDK ({SUPPORTED})")


NXD = NxD()
