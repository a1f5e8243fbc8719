"""One rank's graphs: load the target (and draft) shards, build every (tag, bucket) graph module."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import cpu_kernels
from .checkpoint import build_and_load, convert_hf_to_neuron_state_dict, read_safetensors
from .config import VoxtralConfig
from .drafts import SHAREABLE, check_layer_draft, load_dflash, same_tensors, share_with_target
from .errors import ConfigError
from .contract import ContractViolation, check_graph_call
from .export import Program, export_graph
from .graphs import CACHE_OWNER, DRAFT_KINDS, Buckets, GraphSetup, build_graph, example_inputs, graph_key, graph_plan
from .model import VoxtralModel

DEFAULT_K = {"layers": 4, "ngram": 3}
KV_WRITERS = {tag for tag, owner in CACHE_OWNER.items() if owner}


@dataclass
class Engine:
    setup: GraphSetup
    model: VoxtralModel
    draft: object = None
    graphs: dict = field(default_factory=dict)
    draft_shared: tuple = ()   # drafts.SHAREABLE parts the layer draft takes from the target
    rank: int = 0

    def run(self, tag: str, bucket: int, *inputs):
        with torch.inference_mode():
            return self.graphs[graph_key(tag, bucket, inputs)](*inputs)

    def weight_bytes(self) -> int:
        """Bytes of weights this rank holds (shared modules counted once)."""
        seen, total = set(), 0
        for m in (self.model, self.draft):
            for p in (m.parameters() if m is not None else ()):
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel() * p.element_size()
        return total

    def caches(self) -> dict[str, torch.Tensor]:
        mods = {"target": self.model.language_model}
        if self.draft is not None:
            mods["draft"] = getattr(self.draft, "language_model", self.draft)
        return {f"{who}.{n}": getattr(m, n) for who, m in mods.items() for n in ("k_cache", "v_cache")}

    def clear_caches(self) -> None:
        for c in self.caches().values():
            c.zero_()

    def check_contract(self, spec) -> None:
        """The graph contract (docs/design.md §2) on one graph: no banned op / host sync / int64 at the boundary
        (contract.check_graph_call), and KV caches written in place (same storage, new contents) by exactly the
        graphs that own a cache."""
        name = spec.name
        g = torch.Generator().manual_seed(0)
        inputs = tuple(torch.randn(t.shape, generator=g).to(t.dtype) if t.is_floating_point() else t
                       for t in example_inputs(spec, self.setup))
        self.clear_caches()  # any write of real K/V is then visible
        before = {k: (v.data_ptr(), v.clone()) for k, v in self.caches().items()}
        check_graph_call(name, self.graphs[spec.key], inputs)
        after = self.caches()
        if any(after[k].data_ptr() != ptr for k, (ptr, _) in before.items()):
            raise ContractViolation(f"{name}: a KV cache was replaced instead of updated in place")
        changed = any(not torch.equal(after[k], old) for k, (_, old) in before.items())
        if changed != (spec.tag in KV_WRITERS):
            raise ContractViolation(f"{name}: {'writes' if changed else 'does not write'} a KV cache, "
                                    f"{'expected to' if spec.tag in KV_WRITERS else 'expected not to'}")

    def export(self, out_dir: str) -> list[dict]:
        """Check and export every graph of this rank (the export backend's artifacts). Rank 0 prints progress."""
        out = []
        for spec in graph_plan(self.setup):
            t0 = time.perf_counter()
            self.check_contract(spec)
            path = Path(out_dir) / f"{spec.stem}.rank{self.rank}.pt2"
            names = export_graph(spec.name, self.graphs[spec.key], example_inputs(spec, self.setup), path)
            out.append(dict(tag=spec.tag, bucket=spec.bucket, batch=spec.batch, file=path.name, state_names=names,
                            seconds=time.perf_counter() - t0))
            if self.rank == 0:
                print(f"  {spec.tag:<24} {spec.bucket:>6} {spec.batch:>5}  {out[-1]['seconds']:6.2f} s", flush=True)
        self.clear_caches()  # the example inputs wrote into the KV caches
        return out

    def load_programs(self, art_dir: str, graphs: list[dict]) -> None:
        """Run the exported programs instead of the eager modules (same weights and caches)."""
        for g in graphs:
            key = (g["tag"], g["bucket"], g["batch"])
            path = Path(art_dir) / g["file"].replace("rank0", f"rank{self.rank}")
            self.graphs[key] = Program(path, self.graphs[key], g["state_names"])

    def check_contracts(self) -> None:
        for spec in graph_plan(self.setup):
            self.check_contract(spec)

    def compile(self, target, cache_dir: str | None = None, building: bool = False) -> list[dict]:
        """torch.compile every graph of this rank now for `target` (compiled.Target: the inductor and torchneuron
        backends); building: check the contract on the eager graphs first and fill the artifact's compile cache."""
        from .compiled import compile_engine
        if building:
            self.check_contracts()
        return compile_engine(self, target, cache_dir, building)


def load_voxtral(model_dir, sd: dict, cfg: VoxtralConfig, dtype, buckets: Buckets, tp=1, rank=0, comm=None):
    factory = lambda comm_: VoxtralModel(cfg, buckets.kv_lengths[-1], comm_, buckets.max_batch)  # noqa: E731
    return build_and_load(factory, sd, dtype, str(model_dir), tp, rank, comm)


def check_request(draft, draft_kind, dtype):
    if dtype not in (torch.float32, torch.bfloat16):
        raise ConfigError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    if draft is not None and draft_kind is None:
        draft_kind = "layers"
    if draft_kind is not None and draft_kind not in DRAFT_KINDS:
        raise ConfigError(f"draft_kind must be one of {DRAFT_KINDS}, got {draft_kind!r}")
    if draft_kind in ("layers", "dflash") and draft is None:
        raise ConfigError(f"draft_kind={draft_kind!r} needs a draft checkpoint directory (draft=...)")
    return draft_kind


def build_engine(model_dir, draft=None, draft_kind=None, k=None, dtype=torch.float32, buckets=None, tp=1, rank=0,
                 comm=None) -> Engine:
    """Everything one rank holds. With tp > 1 every rank runs this with its own rank and communicator."""
    draft_kind = check_request(draft, draft_kind, dtype)
    buckets = buckets or Buckets()
    cfg = VoxtralConfig.from_dir(model_dir)
    buckets.validate(cfg)
    target_sd = convert_hf_to_neuron_state_dict(read_safetensors(model_dir))
    model = load_voxtral(model_dir, target_sd, cfg, dtype, buckets, tp, rank, comm)
    setup, draft_model, shared = GraphSetup(cfg, buckets, dtype), None, ()
    if draft_kind == "layers":
        k = DEFAULT_K["layers"] if k is None else k
        draft_cfg = VoxtralConfig.from_dir(draft)
        check_layer_draft(Path(draft), Path(model_dir), draft_cfg, cfg)
        draft_sd = convert_hf_to_neuron_state_dict(read_safetensors(draft))
        shared = tuple(part for part, prefixes in SHAREABLE.items() if same_tensors(draft_sd, target_sd, prefixes))
        from_target = tuple(p for part in shared for p in SHAREABLE[part])
        for key in [k for k in draft_sd if k.startswith(from_target)]:  # build from the target's (mapped) tensors
            draft_sd[key] = target_sd[key]
        draft_model = load_voxtral(draft, draft_sd, draft_cfg, dtype, buckets, tp, rank, comm)
        share_with_target(draft_model, model, shared)
        setup = GraphSetup(cfg, buckets, dtype, "layers", k, draft_own_audio="audio" not in shared)
    elif draft_kind == "dflash":
        dcfg, draft_model = load_dflash(draft, cfg, k, dtype, buckets, tp, rank, comm)
        k = dcfg.block_size - 1 if k is None else k
        setup = GraphSetup(cfg, buckets, dtype, "dflash", k, capture_layers=dcfg.target_layer_ids,
                           dflash_block=dcfg.block_size)
    elif draft_kind == "ngram":
        k = DEFAULT_K["ngram"] if k is None else k
        setup = GraphSetup(cfg, buckets, dtype, "ngram", k)
    if draft_kind is not None and (not isinstance(k, int) or k < 1):
        raise ConfigError(f"num_speculative_tokens must be a positive integer, got {k!r}")
    if cpu_kernels.CPU_OPS and setup.rows_per_call > cpu_kernels.ROW_INVARIANT_ROWS:
        raise ConfigError(f"batch {buckets.max_batch} x {setup.rows_per_call // buckets.max_batch} rows per sequence "
                          f"= {setup.rows_per_call} rows per call exceeds the {cpu_kernels.ROW_INVARIANT_ROWS} rows "
                          f"the CPU kernels keep row-invariant; lower the largest batch bucket or K")
    graphs = {s.key: build_graph(s, setup, model, draft_model) for s in graph_plan(setup)}
    return Engine(setup, model, draft_model, graphs, shared, rank)
