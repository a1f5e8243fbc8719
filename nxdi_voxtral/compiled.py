"""torch.compile of every (tag, bucket) graph (fullgraph=True, dynamic=False): the machinery of the inductor and
torchneuron backends (backends/inductor.py, backends/torchneuron.py), which differ only in their Target:
- INDUCTOR: torch.compile backend "inductor" (C++ kernels) on CPU; weights and KV caches stay where eager has them.
- TORCHNEURON (SDK 2.34+: torch >= 2.10 with torch-neuronx registering the native `neuron` device): backend
  "neuron" (TorchDynamo -> StableHLO -> neuronx-cc -> NEFF), weights and KV caches moved to the device, tensor
  parallelism through torch.distributed's "neuron" process group (the same functional collectives as gloo on CPU).
  Rehearsed up to the compiler on CPU (../shared/torchneuron-rehearsal); not run on a Neuron device.

The KV caches stay in place: the graphs write them with index_copy_ into the model's buffers, which dynamo lifts
as mutated graph inputs and inductor writes back into the same storage (tests/test_compiled.py checks the
data pointers). fullgraph=True makes any graph break an error; dynamic=False keeps one static program per
(tag, bucket). Parameters and buffers are graph inputs, not constants, so a compiled graph does not depend on the
weights: two models of the same shapes in one process (a serving hot swap) share dynamo's compiled code.

The precompiled artifact is the compile cache, per rank: inductor's directory (FX graph + AOT autograd caches and
the built C++ kernels, all under TORCHINDUCTOR_CACHE_DIR), or for TorchNeuron torch's MegaCache bytes
(torch.compiler.save_cache_artifacts(), which TorchNeuron extends with its NEFFs) plus each graph's NEFF cache
keys in the manifest. Loading traces again through dynamo (tracing is not cached by torch); the backend compiles
are answered from the cache.
"""
from __future__ import annotations

import functools
import os
import shutil
import tempfile
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from .graphs import example_inputs, graph_plan

# one graph class (one forward code object) serves every bucket of its tag, and a serving process may hold two
# releases while it swaps: past torch's default of 8 cache entries per code object, fullgraph=True raises
RECOMPILE_LIMIT = 64
INDUCTOR_CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR",)
# dynamic_threads: kernels ask OpenMP for the thread count at run time instead of baking in the compiling
# process's torch.get_num_threads(), which is also part of inductor's cache key: without it an artifact built
# with 2 threads missed the cache in a 1-thread process (and a rank worker runs cpu_count // tp threads).
INDUCTOR_OPTIONS = {"cpp.dynamic_threads": True}
# the C++ wrapper: one shared object per graph instead of a Python wrapper calling one per kernel. Measured on the
# tiny decode graph (1 thread): 0.5 ms a call instead of 0.7 ms (eager 1.5 ms), and about half the compile time.
# Not with tp > 1: torch 2.13's C++ wrapper cannot call the functional collectives ("arg type Any is not yet
# supported by custom_op_wrapper"), so those ranks keep inductor's Python wrapper.
CPP_WRAPPER = {"cpp_wrapper": True}
MEGACACHE = "rank{rank}.megacache"  # torchneuron: torch.compiler.save_cache_artifacts() of rank r (NEFFs included)


@dataclass(frozen=True)
class Target:
    backend: str            # torch.compile backend
    device: str             # where weights, caches and graph inputs live
    process_group: str      # torch.distributed backend for tp > 1
    cpu_ops: bool = True    # graphs use the row-invariant CPU ops (cpu_kernels); False: the device branch
    cache: str = "inductor_dir"  # the artifact's cache: inductor's cache directory, or torch's "megacache" bytes

    def options(self, tp: int) -> dict | None:
        if self.cache != "inductor_dir":
            return None
        return {**INDUCTOR_OPTIONS, **(CPP_WRAPPER if tp == 1 else {})}


INDUCTOR = Target("inductor", "cpu", "gloo")
NEURON_DEVICE = "neuron"  # the device TorchNeuron registers (torch's PrivateUse1)


@functools.cache
def torchneuron_available() -> bool:
    """TorchNeuron: torch >= 2.10 and torch-neuronx registering the `neuron` device. torch-neuronx 2.9 (the
    PyTorch/XLA stack of NxD, SDK <= 2.31) has no native device and is the `neuron` artifact backend instead."""
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 10):
        return False
    try:
        import torch_neuronx  # noqa: F401  (registers the device and the "neuron" process group)
    except ImportError:  # also PyPI's placeholder package
        return False
    return torch._C._get_privateuse1_backend_name() == NEURON_DEVICE


def torchneuron_target() -> Target:
    """torch.compile(backend="neuron"): on a TorchNeuron host the `neuron` device and process group; where only the
    backend is importable (../shared/torchneuron-rehearsal: the real backend source on CPU tensors, up to the
    compiler boundary) CPU tensors and gloo. The graphs take the device branch either way."""
    if torchneuron_available():
        return Target("neuron", NEURON_DEVICE, "neuron", cpu_ops=False, cache="megacache")
    return Target("neuron", "cpu", "gloo", cpu_ops=False, cache="megacache")


def neuron_backend_registered() -> bool:
    """The torch.compile backend name "neuron" resolves (torch-neuronx's entry point, or the rehearsal kit's)."""
    try:
        from torch._dynamo.backends.registry import lookup_backend
        lookup_backend("neuron")
        return True
    except Exception:  # noqa: BLE001  (InvalidBackend, or the backend's own import failing)
        return False


def rank_device(target: Target, rank: int) -> torch.device:
    # one NeuronCore per rank process (untested assumption: the rank's logical core index is its rank)
    return torch.device(target.device, rank) if target.device != "cpu" else torch.device("cpu")


class CompiledGraph:
    """One (tag, bucket) graph, compiled. Host tensors in, host tensors out (as the other backends)."""

    def __init__(self, graph: torch.nn.Module, target: Target, device: torch.device, options: dict | None = None):
        self.graph, self.device = graph, device
        self.fn = torch.compile(graph, fullgraph=True, dynamic=False, backend=target.backend, options=options)

    def __call__(self, *inputs):
        # Dynamo guards on each input's dispatch keys, and an inference tensor has other keys than a normal one:
        # one graph would compile twice (inputs made by the host vs outputs of another graph made under
        # Engine.run's inference_mode). So every call runs under no_grad, not inference_mode, where the graphs
        # make normal tensors, and an inference tensor handed in (made by caller code) is copied once.
        with torch.inference_mode(False), torch.no_grad():
            inputs = tuple(t.clone() if t.is_inference() else t for t in inputs)
            if self.device.type == "cpu":
                return self.fn(*inputs)
            out = self.fn(*(t.to(self.device) for t in inputs))
            return tuple(o.cpu() for o in out)


@contextmanager
def compile_cache(directory: Path):
    """Point torch's on-disk compile caches at `directory` for the block (then restore the environment)."""
    from torch._inductor.utils import clear_caches
    directory.mkdir(parents=True, exist_ok=True)
    old = {name: os.environ.get(name) for name in INDUCTOR_CACHE_ENV}
    os.environ.update({name: str(directory) for name in INDUCTOR_CACHE_ENV})
    clear_caches()  # inductor's in-memory code caches would otherwise answer from the previous directory
    try:
        yield
    finally:
        clear_caches()
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def compile_counts() -> dict[str, int]:
    """traced: graphs dynamo captured; aot_cache_hits: backend compiles answered whole by the AOT-autograd cache;
    inductor_compiles: graphs inductor generated and built code for (FX graph cache misses). TorchNeuron keeps its
    own NEFF cache: the last two stay 0 there."""
    from torch._dynamo.utils import counters
    return {"traced": counters["stats"]["unique_graphs"],
            "aot_cache_hits": counters["aot_autograd"]["autograd_cache_hit"],
            "inductor_compiles": counters["inductor"]["fxgraph_cache_miss"]}


def compile_engine(engine, target: Target, cache_dir: str | None = None, building: bool = False) -> list[dict]:
    """Replace every graph of `engine` (one rank) by its compiled form and compile it now, with example inputs,
    so no request pays for it. Returns one record per graph: seconds, the compile_counts() it moved and (neuron)
    the NEFF cache keys it compiled to.
    cache_dir: the artifact's compile-cache root (inductor: subdirectory `rank{r}`; megacache: file MEGACACHE);
    None: torch's defaults. building: write the cache into cache_dir; otherwise compile from it without writing
    into it (inductor: from a private copy), so a deployed release stays byte-identical to its manifest."""
    from . import cpu_kernels
    rank = engine.rank
    device = rank_device(target, rank)
    if not target.cpu_ops:
        cpu_kernels.CPU_OPS = False  # before any trace: the graphs take the device branch in this process
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    if building:
        # dynamo's in-process cache would answer for graphs another model of the same shapes compiled earlier in
        # this process, and nothing would reach the artifact's cache
        torch._dynamo.reset()
        forget_neff_keys()  # the release holds this build's NEFFs, and each graph's keys are the ones it adds
    if device.type != "cpu":
        for m in (engine.model, engine.draft):
            if m is not None:
                m.to(device)  # caches are buffers: they move with the weights and stay there
    work, cache = None, None
    if cache_dir is not None and target.cache == "inductor_dir":
        cache = Path(cache_dir) / f"rank{rank}"
        if not building:
            work = Path(tempfile.mkdtemp(prefix="nxdi_voxtral_compile_cache_"))
            cache = work / "cache"
            shutil.copytree(Path(cache_dir) / f"rank{rank}", cache)
    megacache = Path(cache_dir) / MEGACACHE.format(rank=rank) if cache_dir and target.cache == "megacache" else None
    if megacache is not None and not building and megacache.stat().st_size:
        torch.compiler.load_cache_artifacts(megacache.read_bytes())  # NEFFs into the runtime's persistent cache
    records = []
    try:
        with compile_cache(cache) if cache is not None else nullcontext():
            for spec in graph_plan(engine.setup):
                key = spec.key
                if not isinstance(engine.graphs[key], CompiledGraph):
                    engine.graphs[key] = CompiledGraph(engine.graphs[key], target, device,
                                                       target.options(engine.model.comm.size))
                if target.cache == "megacache":
                    name_neuron_graph(spec.name)
                    if not building:  # keys an earlier load tracked would hide this graph's (loads save nothing)
                        forget_neff_keys()
                before, neffs = compile_counts(), neff_keys()
                t0 = time.perf_counter()
                engine.run(spec.tag, spec.bucket, *example_inputs(spec, engine.setup))  # under inference_mode
                after = compile_counts()
                records.append(dict(tag=spec.tag, bucket=spec.bucket, batch=spec.batch, seconds=time.perf_counter() - t0,
                                    **{k: after[k] - before[k] for k in after}))
                if neffs is not None:
                    records[-1]["neff_keys"] = sorted(neff_keys() - neffs)
                if rank == 0 and building:
                    print(f"  {spec.tag:<24} {spec.bucket:>6} {spec.batch:>5}  {records[-1]['seconds']:6.2f} s", flush=True)
    finally:
        if work is not None:  # compiled code is loaded: the copy is no longer read
            shutil.rmtree(work, ignore_errors=True)
    if megacache is not None and building:
        saved = torch.compiler.save_cache_artifacts()  # (bytes, info), or None when nothing was recorded
        megacache.parent.mkdir(parents=True, exist_ok=True)
        megacache.write_bytes(saved[0] if saved else b"")
    engine.clear_caches()  # the example inputs wrote into the KV caches
    return records


def name_neuron_graph(name: str) -> None:
    """TorchNeuron names the graphs it compiles next (in its logs, artifacts and metrics) after this."""
    try:
        from torch_neuronx.neuron_dynamo_backend import set_model_name
    except ImportError:
        return
    set_model_name(name)


def forget_neff_keys() -> None:
    try:
        from torch_neuronx.neuron_dynamo_backend.cache_artifact import ArtifactType
        from torch_neuronx.neuron_dynamo_backend.compile import clear_compiled_cache_keys
    except ImportError:
        return
    clear_compiled_cache_keys(ArtifactType.NEURON_NEFF)


def neff_keys() -> set[str] | None:
    """The NEFF cache keys TorchNeuron compiled in this process so far (its MegaCache bookkeeping), or None where
    the backend is not importable. save_cache_artifacts() clears them."""
    try:
        from torch_neuronx.neuron_dynamo_backend.cache_artifact import ArtifactType
        from torch_neuronx.neuron_dynamo_backend.compile import get_compiled_cache_keys
    except ImportError:
        return None
    return set(get_compiled_cache_keys(ArtifactType.NEURON_NEFF))


def summary(records: list[dict]) -> dict:
    return {"seconds": sum(r["seconds"] for r in records), "graphs": len(records),
            **{k: sum(r[k] for r in records) for k in ("traced", "aot_cache_hits", "inductor_compiles")}}
