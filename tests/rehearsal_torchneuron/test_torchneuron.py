"""The torchneuron backend through the real TorchNeuron backend source, on CPU, up to the compiler boundary
(../shared/torchneuron-rehearsal; `.ci/run` runs these in the kit's venv, elsewhere they are not collected).

What is asserted at the boundary, per (tag, bucket) of every draft kind, fp32 and bf16: the graph reaches it; every
KV cache it writes is a must_alias pair and no mutated input is left without one; no leftover torch operator or
custom call; no 64-bit parameter; no collective at tp 1. Then the whole greedy / speculative loop runs on the
handed-over StableHLO (replayed by the kit on XLA:CPU) and gives the eager backend's tokens, writing the caches
in place (no copy-back). Nothing here says that neuronx-cc accepts the modules or how a device computes them.
"""
from __future__ import annotations

import json
import re

import pytest
import torch
import torchneuron_rehearsal as tr

from nxdi_voxtral import ArtifactError, Buckets, NxDVoxtralSpecDec
from nxdi_voxtral.build import main as build_main
from nxdi_voxtral.graphs import CACHE_OWNER, graph_plan

from conftest import noise

B = Buckets(audio_chunks=(1,), kv_lengths=(512,), batch_sizes=(1, 2))  # every decode-side graph at batch 1 and 2
KINDS = ("none", "layers", "dflash", "ngram")
N_NEW = 20


def load(spec_dirs, kind, dtype=torch.float32, **kw):
    draft = {"layers": spec_dirs["layers_high"], "dflash": spec_dirs["dflash"]}.get(kind)
    return NxDVoxtralSpecDec.from_pretrained(spec_dirs["target"], draft=draft,
                                             draft_kind=None if kind == "none" else kind,
                                             num_speculative_tokens=2 if kind in ("layers", "ngram") else None,
                                             dtype=dtype, buckets=B, **kw)


def boundary_rows(m) -> dict[str, dict]:
    """The kit's summary rows of this model's graphs, by graph name (compile_engine names them GraphSpec.name,
    tag[bucket] or tag[bucket, batch b]; the backend appends _<AOT id>...)."""
    rows = {r["graph"][:r["graph"].index("]") + 1]: r for r in tr.summary()}
    return {s.name: rows.get(s.name) for s in graph_plan(m.setup)}


def f64_constants(n: int) -> set[float]:
    """The f64 constants left in record n's module (finding 4: Python floats lowered to f64)."""
    return {float(v) for v in re.findall(r"dense<([^>]+)> : tensor<1xf64>", tr.text(n))}


def backend_made_f64(m) -> set[float]:
    """The f64 constants our graphs cannot avoid: TorchNeuron's own SDPA decomposition makes its scale (1.0 where
    the encoder pre-scales q, else 1/sqrt(head_dim)) a Python float, and layer_norm's decomposition its eps."""
    head_dims = {m.cfg.text.head_dim, m.cfg.audio.hidden_size // m.cfg.audio.num_heads}
    return {1.0, 1e-5} | {d ** -0.5 for d in head_dims}


@pytest.fixture(scope="module")
def prompt(spec_dirs):
    with load(spec_dirs, "none") as m:
        return m.prepare(noise(3.0, seed=4), sampling_rate=16000)


@pytest.fixture(scope="module")
def batch_prompts(spec_dirs, prompt):
    with load(spec_dirs, "none") as m:
        other = m.prepare(noise(7.0, seed=9), sampling_rate=16000)
    return [prompt.input_ids, other.input_ids], [prompt.input_features, other.input_features]


@pytest.fixture(scope="module")
def greedy_on_replay(spec_dirs, prompt):
    """Plain greedy tokens of the torchneuron backend (the replayed modules), per dtype."""
    tokens = {}

    def get(dtype):
        if dtype not in tokens:
            with load(spec_dirs, "none", dtype, backend="torchneuron") as m:
                tokens[dtype] = m.generate(prompt.input_ids, prompt.input_features, max_new_tokens=N_NEW)[0].tolist()
        return tokens[dtype]
    return get


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_graphs_at_the_boundary_and_the_loop_on_them(spec_dirs, prompt, batch_prompts, greedy_on_replay, kind,
                                                     dtype):
    torch._dynamo.reset()
    tr.clear()
    m = load(spec_dirs, kind, dtype, backend="torchneuron")
    rows = boundary_rows(m)
    for name, r in rows.items():
        assert r is not None and r["status"] == "boundary", (name, r)
        writes_cache = CACHE_OWNER[name.split("[")[0]] is not None
        assert len(r["aliases"]) == (2 if writes_cache else 0), (name, r["aliases"])
        assert r["mutated_not_aliased"] == [] and r["alias_problems"] == [], name
        assert len(r["mutated"]) == (2 if writes_cache else 0), name
        assert not [op for op in r["leftover_ops"] if op.startswith(("torch.operator", "stablehlo.custom_call"))], \
            (name, r["leftover_ops"])
        assert r["i64_args"] == [] and r["collectives"] == [], name
        assert f64_constants(r["n"]) <= backend_made_f64(m), (name, f64_constants(r["n"]))
    got = m.generate(prompt.input_ids, prompt.input_features, max_new_tokens=N_NEW)[0].tolist()
    if dtype == torch.float32:
        # the CPU backend's tokens: eager graphs in this process (the same device branch: cpu_kernels.CPU_OPS is off)
        with load(spec_dirs, kind, dtype) as eager:
            assert got == eager.generate(prompt.input_ids, prompt.input_features, max_new_tokens=N_NEW)[0].tolist()
            # two sequences in one batch (batch-2 graphs, two KV slots) on the replayed modules: eager's tokens
            batch = [x[0].tolist() for x in m.generate(*batch_prompts, max_new_tokens=N_NEW)]
            assert batch == [x[0].tolist() for x in eager.generate(*batch_prompts, max_new_tokens=N_NEW)]
            assert batch[0] == got
    elif kind != "none":
        # bf16: XLA:CPU rounds bf16 otherwise than torch's CPU kernels (the tokens part from eager's within ~6 here,
        # and neither is the device), so the promise is checked inside the backend: speculation == plain greedy
        assert got == greedy_on_replay(dtype)
    after = boundary_rows(m)
    assert sum(r["executions"] for r in after.values()) > len(after)  # the loop ran on the replayed modules
    assert all(r["copy_backs"] == 0 for r in after.values())          # caches written in place, never copied back


def test_release_ships_the_neff_cache_and_a_miss_names_the_graph(spec_dirs, tmp_path):
    out = tmp_path / "rel"
    assert build_main(["--model", str(spec_dirs["target"]), "--draft-kind", "ngram", "-k", "2", "--backend",
                       "torchneuron", "--buckets", "audio=1:kv=512", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["backend"] == "torchneuron" and manifest["compile"]["torch_compile_backend"] == "neuron"
    assert "compile_cache/rank0.megacache" in [f["path"] for f in manifest["files"]]
    assert all(len(g["neff_keys"]) == 1 for g in manifest["graphs"]), manifest["graphs"]
    with load(spec_dirs, "ngram") as eager:
        p = eager.prepare(noise(2.0, seed=5), sampling_rate=16000)
        want = eager.generate(p.input_ids, p.input_features, max_new_tokens=N_NEW)[0].tolist()
    torch._dynamo.reset()  # as a fresh host: every graph is traced and handed over again
    # the server's start-up path: load the release (manifest verified), run every graph, transcribe 1 s of silence
    from nxdi_voxtral.serve.host import Source, open_model, warm
    with open_model(Source("artifacts", str(out)), str(out)) as m:
        warm(m)
        assert m.generate(p.input_ids, p.input_features, max_new_tokens=N_NEW)[0].tolist() == want
    # a release whose token_generation NEFF is not the one this host compiles to: refused, naming the graph
    for g in manifest["graphs"]:
        if g["tag"] == "token_generation":
            g["neff_keys"] = ["0" * 64]
    (out / "manifest.json").write_text(json.dumps(manifest))
    torch._dynamo.reset()
    with pytest.raises(ArtifactError, match=r"token_generation\[512\]: compiled to NEFF cache key"):
        NxDVoxtralSpecDec.from_artifacts(out)


def test_artifacts_from_another_compiler_are_refused(spec_dirs, tmp_path):
    out = tmp_path / "rel"
    assert build_main(["--model", str(spec_dirs["target"]), "--backend", "torchneuron", "--buckets",
                       "audio=1:kv=512", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["versions"]["neuron"]["neuronxcc"] = "2.99.0"
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="versions.neuron.neuronxcc"):
        NxDVoxtralSpecDec.from_artifacts(out)


def test_tp2_collectives_name_every_rank_and_every_rank_traces_the_same_graph(spec_dirs, monkeypatch):
    """tp 2 at the FX level, the kit's limit there: upstream torch-mlir cannot lower torch._c10d_functional ops, so
    no module with collectives reaches the boundary (a failure record keeps the post-AOT graph and its collectives,
    after the backend's CollectiveLegalization). Each rank's engine (its own shard, DistComm) is traced in this
    process over torch's fake process group, rank 0 then rank 1."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from nxdi_voxtral import cpu_kernels
    from nxdi_voxtral.compiled import CompiledGraph, name_neuron_graph, torchneuron_target
    from nxdi_voxtral.engine import build_engine
    from nxdi_voxtral.graphs import example_inputs
    from nxdi_voxtral.tp import DistComm
    monkeypatch.setattr(cpu_kernels, "CPU_OPS", False)  # as compile_engine sets it for a torchneuron target
    code, groups = {}, {}
    for rank in (0, 1):
        torch._dynamo.reset()
        tr.clear()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
        try:
            engine = build_engine(spec_dirs["target"], draft=spec_dirs["layers_high"], draft_kind="layers", k=2,
                                  buckets=B, tp=2, rank=rank, comm=DistComm(rank, 2))
            for spec in graph_plan(engine.setup):
                name_neuron_graph(spec.name)
                graph = CompiledGraph(engine.graphs[spec.key], torchneuron_target(), torch.device("cpu"))
                with pytest.raises(Exception, match="Lowering Torch FX IR"):
                    graph(*example_inputs(spec, engine.setup))
            for r in tr.failures():
                name = r["graph_name"][:r["graph_name"].index("]") + 1]
                assert "c10d_functional" in r["error"] and r["collectives"], (name, r["error"])
                # the backend's pre-AOT aliasing analysis (the source of must_alias) ties every mutated input
                assert {m["input"] for m in r["mutated_inputs"]} == \
                    {a["parameter_number"] for a in r["pre_aot"]["aliases"]}, (name, r["pre_aot"])
                code[rank, name] = tr.fx_code(r["n"])
                groups[rank, name] = [c["replica_groups"] for c in r["collectives"]]
        finally:
            dist.destroy_process_group()
    names = sorted({n for _, n in code})
    assert len(names) == len(graph_plan(engine.setup))  # every graph of the layer draft has collectives at tp 2
    for name in names:
        assert code[0, name] and code[0, name] == code[1, name], name  # SPMD: rank is data, not a constant
        assert all(g == [[0, 1]] for g in groups[0, name] + groups[1, name]), (name, groups[0, name])
