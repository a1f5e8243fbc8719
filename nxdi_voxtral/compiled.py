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

The precompiled artifact is the compile cache: inductor's (FX graph + AOT autograd caches and the built C++
kernels, all under TORCHINDUCTOR_CACHE_DIR) or TorchNeuron's NEFF / HLO caches, one directory per rank. Loading
compiles again through dynamo (tracing is not cached by torch) but every backend compile is a cache hit.
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
# TorchNeuron reads these once, at its first compile in the process (set before any device work)
NEURON_CACHE_ENV = ("TORCH_NEURONX_NEFF_CACHE_DIR", "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", "TORCH_NEURONX_HLO_CACHE_DIR")


@dataclass(frozen=True)
class Target:
    backend: str        # torch.compile backend
    device: str         # where weights, caches and graph inputs live
    process_group: str  # torch.distributed backend for tp > 1

    @property
    def cache_env(self) -> tuple[str, ...]:
        return NEURON_CACHE_ENV if self.backend == "neuron" else INDUCTOR_CACHE_ENV


INDUCTOR = Target("inductor", "cpu", "gloo")
TORCHNEURON = Target("neuron", "neuron", "neuron")


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
    return torch._C._get_privateuse1_backend_name() == "neuron"


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
def compile_cache(directory: Path, target: Target):
    """Point torch's on-disk compile caches at `directory` for the block (then restore the environment)."""
    from torch._inductor.utils import clear_caches
    directory.mkdir(parents=True, exist_ok=True)
    old = {name: os.environ.get(name) for name in target.cache_env}
    os.environ.update({name: str(directory) for name in target.cache_env})
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
    so no request pays for it. Returns one record per graph: seconds and the compile_counts() it moved.
    cache_dir: the artifact's compile-cache root (rank subdirectory `rank{r}`); None: torch's defaults.
    building: write the cache into cache_dir; otherwise compile from a private copy of it, so a deployed release
    stays byte-identical to its manifest (and may be read-only) even when a cache miss recompiles."""
    rank = engine.rank
    device = rank_device(target, rank)
    options = None
    if target.backend == "inductor":
        options = {**INDUCTOR_OPTIONS, **(CPP_WRAPPER if engine.model.comm.size == 1 else {})}
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    if building:
        # dynamo's in-process cache would answer for graphs another model of the same shapes compiled earlier in
        # this process, and nothing would reach the artifact's cache
        torch._dynamo.reset()
    if device.type != "cpu":
        for m in (engine.model, engine.draft):
            if m is not None:
                m.to(device)  # caches are buffers: they move with the weights and stay there
    work = None
    if cache_dir is None:
        cache = None
    elif building:
        cache = Path(cache_dir) / f"rank{rank}"
    else:
        work = Path(tempfile.mkdtemp(prefix="nxdi_voxtral_compile_cache_"))
        cache = work / "cache"
        shutil.copytree(Path(cache_dir) / f"rank{rank}", cache)
    records = []
    try:
        with compile_cache(cache, target) if cache is not None else nullcontext():
            for spec in graph_plan(engine.setup):
                key = (spec.tag, spec.bucket)
                if not isinstance(engine.graphs[key], CompiledGraph):
                    engine.graphs[key] = CompiledGraph(engine.graphs[key], target, device, options)
                before = compile_counts()
                t0 = time.perf_counter()
                engine.run(spec.tag, spec.bucket, *example_inputs(spec, engine.setup))  # under inference_mode
                after = compile_counts()
                records.append(dict(tag=spec.tag, bucket=spec.bucket, seconds=time.perf_counter() - t0,
                                    **{k: after[k] - before[k] for k in after}))
                if rank == 0 and building:
                    print(f"  {spec.tag:<24} {spec.bucket:>6}  {records[-1]['seconds']:6.2f} s", flush=True)
    finally:
        if work is not None:  # compiled code is loaded: the copy is no longer read
            shutil.rmtree(work, ignore_errors=True)
    engine.clear_caches()  # the example inputs wrote into the KV caches
    return records


def summary(records: list[dict]) -> dict:
    return {"seconds": sum(r["seconds"] for r in records), "graphs": len(records),
            **{k: sum(r[k] for r in records) for k in ("traced", "aot_cache_hits", "inductor_compiles")}}
