"""The CPU backend's compiled artifacts: one torch.export program per (tag, bucket, rank).

Weights and KV caches are not inside a program: they are its first argument (a tuple of the graph module's
parameters and buffers, in `state_names` order), so every program of a rank shares one copy of the weights and
writes the one KV cache in place (the exported graph keeps the in-place index_copy_) — the NEFF + separate
weights split NxD makes.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .contract import BANNED_OPS, ContractViolation
from .errors import ArtifactError


def state_names(graph: nn.Module) -> list[str]:
    return [n for n, _ in graph.named_parameters()] + [n for n, _ in graph.named_buffers()]


def state_of(graph: nn.Module) -> tuple:
    tensors = dict(graph.named_parameters())
    tensors.update(dict(graph.named_buffers()))
    return tuple(tensors[n] for n in state_names(graph))


class _Functional(nn.Module):
    def __init__(self, graph: nn.Module):
        super().__init__()
        object.__setattr__(self, "graph", graph)  # not a submodule: its tensors must not be baked in
        self.names = state_names(graph)

    def forward(self, state, *inputs):
        return torch.func.functional_call(self.graph, dict(zip(self.names, state)), inputs, strict=True)


def export_graph(name: str, graph: nn.Module, inputs: tuple, path: Path) -> list[str]:
    with torch.no_grad():
        ep = torch.export.export(_Functional(graph), (state_of(graph),) + tuple(inputs), strict=False)
    ops = {str(n.target).split(".")[1] for n in ep.graph.nodes if n.op == "call_function" and
           str(n.target).startswith("aten.")}
    banned = sorted(ops & BANNED_OPS)
    if banned:
        raise ContractViolation(f"{name}: banned op(s) in the exported graph: {', '.join(banned)}")
    ep._example_inputs = None  # the example state is the weights: do not store them with the program
    torch.export.save(ep, str(path))
    return state_names(graph)


class Program:
    """A loaded exported graph bound to the live weights and caches of this rank's graph module."""

    def __init__(self, path: Path, graph: nn.Module, expected_names: list[str]):
        if state_names(graph) != expected_names:
            raise ArtifactError(f"{path.name}: the program's weight/state layout does not match this model")
        try:
            self.module = torch.export.load(str(path)).module()
        except Exception as e:  # a damaged archive surfaces as zip, unpickling or decode errors
            raise ArtifactError(f"{path.name}: cannot load the exported program ({type(e).__name__}: {e}); the file "
                                f"is damaged (from_artifacts with verify_hashes=True names it by sha256)") from None
        self.state = state_of(graph)

    def __call__(self, *inputs):
        return tuple(self.module(self.state, *inputs))
