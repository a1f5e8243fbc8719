"""Neuron backends (SDK <= 2.31: NxD ModelBuilder -> NEFFs; SDK >= 2.32: TorchNeuron torch.compile).

UNVERIFIED: no Neuron SDK or Trainium is available where this package is developed; the calls below follow the
signatures in shared/NEURON_API.md (NxD 0.18 V1 ModelBuilder). The graphs themselves are the modules verified on
CPU; what is unverified is this hand-off. Imports are lazy: nothing here runs without the SDK.
"""
from __future__ import annotations

from functools import partial

from .errors import ArtifactError


def _require_nxd():
    try:
        from neuronx_distributed.trace.model_builder import BaseModelInstance, ModelBuilder
    except ImportError as e:
        raise ArtifactError("backend neuron needs the Neuron SDK (neuronx-distributed, torch-neuronx, neuronx-cc "
                            f"from AWS's Neuron repository); not importable here ({e}). Use --backend cpu.") from None
    return BaseModelInstance, ModelBuilder


COMPILER_ARGS = {"context_encoding": "--auto-cast=none --model-type=transformer --lnc=2 -O1",
                 "audio_encoder": "--auto-cast=none --model-type=transformer --lnc=2 -O1"}
DEFAULT_ARGS = "--auto-cast=none --model-type=transformer --lnc=2 -O2"


def compile_neuron(model, out, draft, draft_kind, k, tp, buckets, dtype):  # pragma: no cover - needs Neuron
    """One ModelBuilder key per tag, one example tuple per bucket (graph_plan / example_inputs), traced at tp."""
    BaseModelInstance, ModelBuilder = _require_nxd()
    from .checkpoint import convert_hf_to_neuron_state_dict, read_safetensors
    from .engine import build_engine
    from .graphs import build_graph, example_inputs, graph_plan
    engine = build_engine(model, draft, draft_kind, k, dtype, buckets)  # rank-0 module structure for tracing
    builder = ModelBuilder(router=None, tp_degree=tp, logical_nc_config=2, compiler_workdir=str(out / "workdir"),
                           checkpoint_loader=lambda: convert_hf_to_neuron_state_dict(read_safetensors(model)))
    by_tag: dict[str, list] = {}
    for spec in graph_plan(engine.setup):
        by_tag.setdefault(spec.tag, []).append(spec)
    for tag, specs in by_tag.items():
        module = partial(build_graph, specs[0], engine.setup, engine.model, engine.draft)
        builder.add(key=tag, model_instance=BaseModelInstance(module, input_output_aliases={}),
                    example_inputs=[example_inputs(s, engine.setup) for s in specs],
                    compiler_args=COMPILER_ARGS.get(tag, DEFAULT_ARGS), priority_model_idx=0)
    traced = builder.trace(initialize_model_weights=False)
    import torch
    out.mkdir(parents=True, exist_ok=True)
    torch.jit.save(traced, str(out / "model.pt"))
    raise ArtifactError("neuron backend: model.pt written, but KV-cache aliasing, sharded weights and the manifest "
                        "for Neuron are not implemented yet (see README, 'verified where')")
