"""The nxd backend (Neuron SDK <= 2.33, Trn1 / Inf2; backends/nxd.py): every (tag, bucket) graph through NxD's V1
ModelBuilder to neuronx-cc.

The graph modules are the ones the CPU backend runs (graphs.build_graph); here they are built with NxD's parallel
layers (NxDComm), wrapped so that every graph has the same weight names (`target.*`, `draft.*`) and returns the
KV cache it writes, aliased to the input state. NxD traces rank 0 only and runs that one HLO on every rank (SPMD):
the rank enters as SPMDRank weights, never as a Python int. Weights are sharded by NxD (`shard_checkpoint`).

Why ModelBuilder directly and not NxDI's NeuronApplicationBase / ModelWrapper: ModelWrapper's tags and input
tuples are those of a text decoder (input_ids, attention_mask, position_ids, seq_ids, sampling params), its
aliasing is per-layer past_key_values, and fused speculation is refused for multimodal models; fitting the audio
encoder, the three drafts and in-graph greedy verify would need patches to NxDI. ModelBuilder takes our modules as
they are. Imports are lazy: nothing here runs without the SDK (or ../shared/neuron-rehearsal's stand-ins).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from .errors import ArtifactError
from .tp import Comm

LNC = 2
SUPPORTED = "Neuron SDK <= 2.33 (Trn1, Inf2, Trn2 pinned to 2.33); from SDK 2.34 on Trn2/Trn3 use --backend torchneuron"
PREFILL_TAGS = ("audio_encoder", "context_encoding", "draft_context_encoding", "dflash_context")
# NxDI's flags for Llama-class models on trn2: -O1 for prefill-like graphs, -O2 for decode-like ones
COMPILER_ARGS = "--auto-cast=none --model-type=transformer --lnc={lnc} {opt}"
WEIGHTS_DIR = "sharded_weights"


def compiler_args(tag: str) -> str:
    return COMPILER_ARGS.format(lnc=LNC, opt="-O1" if tag in PREFILL_TAGS else "-O2")


def require_nxd():
    try:
        from neuronx_distributed.trace.model_builder import BaseModelInstance, ModelBuilder
    except ImportError as e:
        raise ArtifactError("backend nxd needs torch-neuronx 2.9, neuronx-cc and neuronx-distributed from AWS's "
                            f"Neuron repository; not importable here ({e}). {SUPPORTED}; on CPU use --backend "
                            "export") from None
    return BaseModelInstance, ModelBuilder


class NxDComm(Comm):
    """The tensor-parallel group inside NxD tracing: NxD's parallel layers and collectives (there is no
    torch.distributed process group while ModelBuilder traces)."""

    def __init__(self, dtype: torch.dtype):
        from neuronx_distributed.parallel_layers import parallel_state
        self.size, self.rank, self.dtype = parallel_state.get_tensor_model_parallel_size(), 0, dtype

    def all_reduce(self, x):
        from neuronx_distributed.parallel_layers.mappings import reduce_from_tensor_model_parallel_region
        return reduce_from_tensor_model_parallel_region(x)

    def all_gather(self, x):
        from neuronx_distributed.parallel_layers.mappings import gather_from_tensor_model_parallel_region
        return gather_from_tensor_model_parallel_region(x.unsqueeze(-1)).movedim(-1, 0)

    def column(self, in_features, out_features, bias=True):
        from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear
        return ColumnParallelLinear(in_features, out_features, bias=bias, gather_output=False, dtype=self.dtype)

    def row(self, in_features, out_features, bias=True):
        from neuronx_distributed.parallel_layers.layers import RowParallelLinear
        return RowParallelLinear(in_features, out_features, bias=bias, input_is_parallel=True, dtype=self.dtype)

    def kv_column(self, in_features, n_kv, head_dim):
        if self.size <= n_kv:
            return self.column(in_features, n_kv * head_dim, bias=False)
        return replicated_kv_column(in_features, n_kv, head_dim, self.size, self.dtype)

    def vocab_embedding(self, vocab, dim):
        from neuronx_distributed.parallel_layers.layers import ParallelEmbedding
        return ParallelEmbedding(vocab, dim, dtype=self.dtype, pad=True, use_spmd_rank=self.size > 1)

    def vocab_head(self, dim, vocab):
        from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear
        return ColumnParallelLinear(dim, vocab, bias=False, gather_output=False, pad=True, dtype=self.dtype)

    def spmd_rank(self):
        from neuronx_distributed.parallel_layers.layers import SPMDRank
        return SPMDRank(world_size=self.size) if self.size > 1 else None


def replicated_kv_column(in_features, n_kv, head_dim, tp, dtype):
    """tp > n_kv: each rank holds one kv head (rank r: head r // (tp / n_kv)), the sharding tp.shard_tensor does
    on CPU. NxD gets it as a column-parallel layer over tp heads whose preshard hook repeats each checkpoint head."""
    from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear

    class ReplicatedKVColumn(ColumnParallelLinear):
        def preshard_hook(self, state_dict, key):
            w = state_dict[key]
            state_dict[key] = w.view(n_kv, head_dim, -1).repeat_interleave(tp // n_kv, 0).reshape(tp * head_dim, -1)

    return ReplicatedKVColumn(in_features, tp * head_dim, bias=False, gather_output=False, dtype=dtype)


class Models(nn.Module):
    """target (+ draft): the one set of weight names every traced graph shares."""

    def __init__(self, target: nn.Module, draft: nn.Module | None):
        super().__init__()
        self.target, self.draft = target, draft


class StatefulGraph(nn.Module):
    """One (tag, bucket) graph as NxD traces it: outputs = (k_cache, v_cache written by this graph) + the graph's
    own outputs; the caches are aliased to the input state, so NxD updates them on device and returns only the
    graph's outputs."""

    def __init__(self, models: Models, graph: nn.Module, cache_owner: str | None):
        super().__init__()
        self.target, self.draft = models.target, models.draft
        object.__setattr__(self, "graph", graph)  # not a submodule: its tensors are target's / draft's
        self.cache_owner = cache_owner

    def caches(self) -> tuple:
        """Looked up at call time: the tracer swaps the module's tensors for device ones."""
        from .graphs import kv_caches
        return kv_caches(getattr(self, self.cache_owner)) if self.cache_owner else ()

    def forward(self, *inputs):
        out = tuple(self.graph(*inputs))
        return self.caches() + out


def build_models(plan: "NeuronPlan", comm: Comm) -> Models:
    from .dflash import DFlashDraft
    from .drafts import share_with_target
    from .model import VoxtralModel
    s = plan.setup
    max_len, slots = s.buckets.kv_lengths[-1], s.buckets.max_batch
    target = VoxtralModel(s.cfg, max_len, comm, slots)
    draft = None
    if s.draft_kind == "layers":
        draft = VoxtralModel(plan.draft_cfg, max_len, comm, slots)
        share_with_target(draft, target, plan.draft_shared)
    elif s.draft_kind == "dflash":
        draft = DFlashDraft(plan.draft_cfg, max_len, comm, slots)
    return Models(target, draft).to(s.dtype).eval()  # caches included: built zeroed, cast with the weights


class NeuronPlan:
    """What the Neuron build needs, read from a CPU engine at tp 1: the graph setup, the draft's config and which
    parts the layer draft shares with the target."""

    def __init__(self, engine, model_dir, draft_dir):
        self.setup, self.model_dir, self.draft_dir = engine.setup, Path(model_dir), draft_dir
        self.draft_shared = engine.draft_shared
        self.draft_cfg = engine.draft.cfg if engine.draft is not None else None

    def checkpoint(self, tp: int) -> dict[str, torch.Tensor]:
        """The full (unsharded) state dict under the traced modules' names; NxD shards it per rank."""
        from .checkpoint import check_and_cast, convert_hf_to_neuron_state_dict, read_safetensors
        from .drafts import read_dflash_state_dict
        from .tp import SINGLE
        with torch.device("meta"):
            whole = build_models(self, SINGLE)
        s, out = self.setup, {}
        sources = [("target", self.model_dir, convert_hf_to_neuron_state_dict(read_safetensors(self.model_dir)))]
        if s.draft_kind == "layers":
            sources.append(("draft", self.draft_dir, convert_hf_to_neuron_state_dict(read_safetensors(self.draft_dir))))
        elif s.draft_kind == "dflash":
            sources.append(("draft", self.draft_dir, read_dflash_state_dict(self.draft_dir)))
        for role, src, sd in sources:
            for k, v in check_and_cast(sd, getattr(whole, role), s.dtype, str(src)).items():
                out[f"{role}.{k}"] = v
        # SPMDRank weights: arange(tp), split on dim 0 by NxD
        with torch.device("meta"):
            names = list(build_models(self, _MetaComm(tp)).state_dict())
        out.update({k: torch.arange(tp, dtype=torch.int32) for k in names if k.endswith(".rank")})
        return out


class _MetaComm(Comm):
    """Only for listing the state-dict names a tp-rank model has (SPMDRank weights appear when size > 1)."""

    def __init__(self, size):
        self.size = size


def make_builder(plan: NeuronPlan, tp: int, workdir: Path, progress=print):
    """A ModelBuilder with one key per graph tag and one example tuple per bucket (graph_plan / example_inputs)."""
    BaseModelInstance, ModelBuilder = require_nxd()
    from .graphs import CACHE_OWNER, build_graph, example_inputs, graph_plan

    class GraphInstance(BaseModelInstance):
        """The models are built once per tag (under NxD's parallel state); get(bucket) wraps that bucket's graph
        module (bucket-specific shapes, e.g. the KV length a token_generation graph attends over)."""

        def __init__(self, tag, specs):
            super().__init__(None, input_output_aliases={})
            self.tag, self.specs = tag, specs

        def load_module(self):
            self.module = build_models(plan, NxDComm(plan.setup.dtype))

        def get(self, bucket_rank, **kwargs):
            spec = self.specs[bucket_rank]
            models = self.module
            graph = build_graph(spec, plan.setup, models.target, models.draft)
            wrapped = StatefulGraph(models, graph, CACHE_OWNER[spec.tag])
            progress(f"  tracing {spec.tag:<24} {spec.bucket:>6} {spec.batch:>5}")
            return wrapped, {c: i for i, c in enumerate(wrapped.caches())}

    builder = ModelBuilder(router=None, tp_degree=tp, checkpoint_loader=lambda: plan.checkpoint(tp),
                           compiler_workdir=str(workdir), logical_nc_config=LNC)
    by_tag: dict[str, list] = {}
    for spec in graph_plan(plan.setup):
        by_tag.setdefault(spec.tag, []).append(spec)
    for tag, specs in by_tag.items():
        builder.add(key=tag, model_instance=GraphInstance(tag, specs),
                    example_inputs=[example_inputs(s, plan.setup) for s in specs], compiler_args=compiler_args(tag))
    return builder


def compile_neuron(engine, model_dir, draft_dir, out: Path, tp: int, progress=print) -> dict:
    """Shard the weights per rank (NxD's checkpoint path), trace every graph and hand it to neuronx-cc; writes
    model.pt (all NEFFs, TorchScript) and weights/tp{r}_sharded_checkpoint.safetensors. Returns the graph list."""
    plan = NeuronPlan(engine, model_dir, draft_dir)
    builder = make_builder(plan, tp, out / "compiler_workdir", progress)
    t0 = time.perf_counter()
    progress(f"sharding weights for tp={tp} -> {out / WEIGHTS_DIR}")
    builder.shard_checkpoint(serialize_path=str(out / WEIGHTS_DIR))
    progress(f"tracing and compiling {sum(len(c.example_inputs) for c in builder.model_collection.values())} "
             f"graphs (neuronx-cc; this takes minutes per graph at full size)")
    traced = builder.trace(initialize_model_weights=False)
    torch.jit.save(traced, str(out / "model.pt"))
    progress(f"traced and compiled in {time.perf_counter() - t0:.1f} s")
    from .graphs import graph_plan
    return [dict(tag=s.tag, bucket=s.bucket, batch=s.batch, compiler_args=compiler_args(s.tag))
            for s in graph_plan(plan.setup)]


class NeuronRanks:
    """Runs the compiled model.pt on a Neuron host (the rank interface of ranks.py): NxD picks the graph by input
    shapes and runs it on every rank; aliased caches stay on device, so each call returns only the graph's outputs."""

    pids: list[int] = []

    def __init__(self, art_dir: Path, manifest: dict, build_kwargs: dict):
        try:
            import torch_neuronx  # noqa: F401  (registers the TorchScript classes model.pt refers to)
            from safetensors.torch import load_file
        except ImportError as e:
            raise ArtifactError(f"artifacts for backend nxd need torch-neuronx on this host ({e})") from None
        from .config import VoxtralConfig
        from .graphs import GraphSetup
        self.tp = manifest["tp"]
        self.setup = GraphSetup.from_manifest(manifest, VoxtralConfig.from_dir(build_kwargs["model_dir"]))
        self.traced = torch.jit.load(str(art_dir / "model.pt"))
        weights = [load_file(str(art_dir / WEIGHTS_DIR / f"tp{r}_sharded_checkpoint.safetensors"))
                   for r in range(self.tp)]
        self.traced.nxd_model.initialize(weights, torch.tensor([0], dtype=torch.int32))

    def run(self, tag: str, bucket: int, *inputs):
        out = self.traced(*inputs)
        return tuple(out) if isinstance(out, (list, tuple)) else (out,)

    def call(self, method: str, *args) -> list:
        raise ArtifactError(f"{method}: the NxD runtime holds NEFFs, not engines")

    def dead(self) -> bool:
        return False

    def close(self) -> None:
        pass
