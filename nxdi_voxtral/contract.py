"""The graph contract of docs/design.md §2, checked on CPU: banned ops, host syncs, int32 boundaries, static shapes,
distinct input signatures per (tag, bucket)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import ConfigError

# ops Neuron's XLA path rejects or that make shapes data-dependent
BANNED_OPS = {"masked_scatter", "sort", "argsort", "nonzero", "unique", "_unique", "_unique2", "unique_consecutive",
              "unique_dim", "masked_select", "_local_scalar_dense", "item", "nonzero_static", "topk"}


class ContractViolation(ConfigError):
    """A graph breaks the tracing contract (banned op, boolean indexing, wrong boundary dtype, ...)."""


class OpRecorder(TorchDispatchMode):
    """Records every aten op that runs, and flags boolean-mask indexing."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.bool_indexing = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops.append(name)
        if name in ("index", "index_put", "index_put_") and len(args) > 1:
            idx = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx):
                self.bool_indexing = True
        return func(*args, **(kwargs or {}))


def check_graph_call(name: str, graph, inputs: tuple) -> tuple:
    """Run `graph(*inputs)` recording ops; raise ContractViolation naming the graph and the op. Returns outputs."""
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor):
            raise ContractViolation(f"{name}: input {i} is {type(t).__name__}, graphs take tensors only")
        if t.dtype == torch.int64:
            raise ContractViolation(f"{name}: input {i} is int64; ids and indices cross graph boundaries as int32")
    rec = OpRecorder()
    with torch.inference_mode(), rec:
        outputs = graph(*inputs)
    banned = sorted(set(rec.ops) & BANNED_OPS)
    if banned:
        raise ContractViolation(f"{name}: banned op(s) inside the graph: {', '.join(banned)}")
    if rec.bool_indexing:
        raise ContractViolation(f"{name}: boolean-mask indexing inside the graph")
    if not isinstance(outputs, tuple) or not all(isinstance(o, torch.Tensor) for o in outputs):
        raise ContractViolation(f"{name}: a graph returns a tuple of tensors")
    for i, o in enumerate(outputs):
        if o.dtype == torch.int64:
            raise ContractViolation(f"{name}: output {i} is int64; must be int32")
    return outputs


def signature(inputs: tuple) -> tuple:
    return tuple(tuple(t.shape) for t in inputs)


def check_distinct_signatures(signatures: dict) -> None:
    """NxD routes a call to a compiled graph by input shapes alone: no two (tag, bucket) may share them."""
    seen = {}
    for key, sig in signatures.items():
        if sig in seen:
            raise ContractViolation(f"graphs {seen[sig]} and {key} have the same input shapes {sig}")
        seen[sig] = key
