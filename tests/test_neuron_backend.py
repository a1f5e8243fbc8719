"""What the Neuron backend needs from the graphs, checked on CPU: one traced graph serves every rank (the rank is
data), and Neuron artifacts are refused on a host whose Neuron stack differs from the one that built them."""
import pytest
import torch

from nxdi_voxtral.checkpoint import convert_hf_to_neuron_state_dict, read_safetensors
from nxdi_voxtral.config import VoxtralConfig
from nxdi_voxtral.engine import load_voxtral
from nxdi_voxtral.errors import ArtifactError
from nxdi_voxtral.graphs import GraphSpec, GraphSetup, build_graph, example_inputs
from nxdi_voxtral.tp import Comm

from conftest import SMALL_BUCKETS


class LoopbackComm(Comm):
    """Shape-correct stand-in collectives: enough to trace one rank's graph without a process group."""

    def __init__(self, size):
        self.size = size

    def all_reduce(self, x):
        return x * 1

    def all_gather(self, x):
        return torch.stack([x] * self.size)


@pytest.mark.parametrize("tag", ["token_generation", "context_encoding"])
def test_one_graph_serves_every_rank(tiny_dir, tag):
    """The programs traced with rank 0's and rank 1's weights are the same graph: nothing rank-specific (vocab
    offset, kv head) is a trace-time constant; the ranks differ only in their weights, SPMDRank included."""
    cfg = VoxtralConfig.from_dir(tiny_dir)
    sd = convert_hf_to_neuron_state_dict(read_safetensors(tiny_dir))
    setup, spec, codes, ranks = GraphSetup(cfg, SMALL_BUCKETS), GraphSpec(tag, 512 if tag != "context_encoding" else 1), [], []
    for rank in (0, 1):
        model = load_voxtral(tiny_dir, sd, cfg, torch.float32, SMALL_BUCKETS, 2, rank, LoopbackComm(2))
        graph = build_graph(spec, setup, model)
        ep = torch.export.export(graph, example_inputs(spec, setup), strict=False)
        codes.append(ep.graph_module.code)
        ranks.append(model.spmd_rank.rank.tolist() + model.language_model.embed_tokens.rank_util.rank.tolist())
    assert codes[0] == codes[1]
    assert ranks == [[0, 0], [1, 1]]


NEURON = {"torch_neuronx": "2.9.0.2.15.32035", "neuronxcc": "2.27.5334.0", "neuronx_distributed": "0.19.28492",
          "neuronx_distributed_inference": "0.10.18399", "nki": "0.5.0"}


def manifest_for(neuron):
    return {"backend": "nxd", "tp": 4, "versions": {"torch": torch.__version__, "neuron_sdk": neuron["torch_neuronx"],
                                                        "neuron": dict(neuron)}}


def test_neuron_artifacts_need_the_stack_they_were_built_with(monkeypatch):
    from nxdi_voxtral import backends, manifest as mf
    real = mf.host_versions
    monkeypatch.setattr(mf, "host_versions", lambda: {**real(), "neuron_sdk": None,
                                                      "neuron": {k: None for k in NEURON}})
    with pytest.raises(ArtifactError, match="no Neuron SDK"):
        backends.check_host(manifest_for(NEURON), None)
    other = {**NEURON, "neuronxcc": "2.26.1.0"}
    monkeypatch.setattr(mf, "host_versions", lambda: {**real(), "neuron_sdk": other["torch_neuronx"], "neuron": other})
    with pytest.raises(ArtifactError, match="versions.neuron.neuronxcc"):
        backends.check_host(manifest_for(NEURON), None)
    monkeypatch.setattr(mf, "host_versions", lambda: {**real(), "neuron_sdk": NEURON["torch_neuronx"], "neuron": NEURON})
    backends.check_host(manifest_for(NEURON), 4)
    with pytest.raises(ArtifactError, match="tp"):
        backends.check_host(manifest_for(NEURON), 2)
