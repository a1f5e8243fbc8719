"""The per-graph table of docs/neuron.md: every (tag, bucket) of every draft kind at the TorchNeuron compiler
boundary (tp 1), and at the FX level for tp 2 (collectives and their rank lists), from the rehearsal kit.

    . ../shared/torchneuron-rehearsal/env.sh && python tests/rehearsal_torchneuron/report.py [--dtype bf16]
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torchneuron_rehearsal as tr  # noqa: E402

from nxdi_voxtral import Buckets, NxDVoxtralSpecDec  # noqa: E402
from nxdi_voxtral.config import TextConfig, VoxtralConfig  # noqa: E402
from nxdi_voxtral.graphs import graph_plan  # noqa: E402

B = Buckets(audio_chunks=(1,), kv_lengths=(512,), batch_sizes=(1, 2))


def checkpoints(root: str) -> dict:
    from conftest import make_cfg
    from nxdi_voxtral.synthetic import random_state_dict, write_checkpoint, write_layer_draft, write_random_dflash
    cfg = make_cfg("mha_hd16")
    cfg = VoxtralConfig(audio=cfg.audio, text=TextConfig(**{**cfg.text.__dict__, "num_layers": 4}))
    target = write_checkpoint(os.path.join(root, "target"), cfg, random_state_dict(cfg, 11))
    return {"target": target, "layers": write_layer_draft(target, os.path.join(root, "draft"), [0, 2]),
            "dflash": write_random_dflash(os.path.join(root, "dflash"), cfg, target_layer_ids=(0, 2), num_layers=2,
                                          seed=5)}


def graph_name(r: dict) -> str:
    return r["graph"][:r["graph"].index("]") + 1]


def tp1_rows(dirs: dict, kind: str, dtype) -> list[str]:
    torch._dynamo.reset()
    tr.clear()
    m = NxDVoxtralSpecDec.from_pretrained(dirs["target"], draft=dirs.get(kind), buckets=B, dtype=dtype,
                                          draft_kind=None if kind == "none" else kind, backend="torchneuron",
                                          num_speculative_tokens=2 if kind in ("layers", "ngram") else None)
    rows = {graph_name(r): r for r in tr.summary()}
    out = []
    for s in graph_plan(m.setup):
        r = rows[s.name]
        f64 = sorted({float(v) for v in re.findall(r"dense<([^>]+)> : tensor<1xf64>", tr.text(r["n"]))})
        left = ", ".join(f"{k} x{v}" for k, v in r["leftover_ops"].items()) or "none"
        out.append(f"| {s.tag} | {s.bucket} | {s.batch} | {kind} | {r['status']} | {len(r['aliases'])} | "
                   f"{', '.join(r['mutated_not_aliased']) or 'none'} | {r['copy_backs']} | - | {left} | "
                   f"{', '.join(f'{x:g}' for x in f64) or 'none'} |")
    return out


def tp2_rows(dirs: dict, kind: str) -> list[str]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from nxdi_voxtral import cpu_kernels
    from nxdi_voxtral.compiled import CompiledGraph, name_neuron_graph, torchneuron_target
    from nxdi_voxtral.engine import build_engine
    from nxdi_voxtral.graphs import example_inputs
    from nxdi_voxtral.tp import DistComm
    cpu_kernels.CPU_OPS = False
    code, out = {}, []
    for rank in (0, 1):
        torch._dynamo.reset()
        tr.clear()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
        try:
            engine = build_engine(dirs["target"], draft=dirs.get(kind), draft_kind=None if kind == "none" else kind,
                                  k=2 if kind in ("layers", "ngram") else None, buckets=B, tp=2, rank=rank,
                                  comm=DistComm(rank, 2))
            for s in graph_plan(engine.setup):
                name_neuron_graph(s.name)
                try:
                    CompiledGraph(engine.graphs[s.key], torchneuron_target(),
                                  torch.device("cpu"))(*example_inputs(s, engine.setup))
                except Exception:  # noqa: BLE001  (the expected stop: collectives are not lowered upstream)
                    pass
            for r in sorted(tr.records() + tr.failures(), key=lambda r: r["n"]):
                name = r["graph_name"][:r["graph_name"].index("]") + 1]
                code[rank, name] = tr.fx_code(r["n"])
                if rank == 1:
                    colls = ", ".join(sorted({f"{c['op'].split('.')[-1]} {c['replica_groups']}"
                                              for c in r["collectives"]})) or "none"
                    aliased = {a["parameter_number"] for a in r["pre_aot"]["aliases"]}
                    unaliased = [m["name"] for m in r["mutated_inputs"] if m["input"] not in aliased]
                    out.append(f"| {name} | {kind} | {r.get('status', 'boundary')} | {colls} | "
                               f"{'yes' if code[0, name] == code[1, name] else 'NO'} | {len(r['mutated_inputs'])} | "
                               f"{', '.join(unaliased) or 'none'} |")
        finally:
            dist.destroy_process_group()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--kinds", default="none,layers,dflash,ngram")
    a = ap.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    kinds = a.kinds.split(",")
    with tempfile.TemporaryDirectory() as root:
        dirs = checkpoints(root)
        print("| tag | bucket | batch | draft | status | must_alias | mutated, not aliased | copy-backs | collectives | "
              "leftover ops | f64 constants left |\n|---|---|---|---|---|---|---|---|---|---|---|")
        for kind in kinds:
            print("\n".join(tp1_rows(dirs, kind, dtype)), flush=True)
        print("\ntp 2 (FX level; rank 0 and rank 1 traced over torch's fake process group)\n")
        print("| graph | draft | status | collectives (replica groups) | rank 0 FX == rank 1 FX | mutated inputs | "
              "mutated, not aliased (pre-AOT analysis) |\n|---|---|---|---|---|---|---|")
        for kind in kinds:
            print("\n".join(tp2_rows(dirs, kind)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
