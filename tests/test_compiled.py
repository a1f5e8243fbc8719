"""The compiled backend (torch.compile, inductor on this CPU): the eager backend's tokens for every draft kind at
tp 1 and for one at tp 2, no graph break, no recompile over a whole generate, KV caches written in place, and an
artifact whose compile cache makes a deployed load compile nothing.

Inductor compiles are slow on a small CPU: one bucket per kind, and the artifact test runs first so the tp 1 tests
reuse its compiled audio encoder / prefill / decode graphs (dynamo shares them between models of the same shapes)."""
import json

import pytest
import torch
from torch._dynamo.utils import counters

from nxdi_voxtral.release import deploy, pack
from nxdi_voxtral.build import main as build_main
from nxdi_voxtral import ArtifactError, Buckets, NxDVoxtralSpecDec
from nxdi_voxtral.compiled import INDUCTOR, CompiledGraph, summary
from nxdi_voxtral.manifest import SCHEMA_VERSION

from conftest import noise

B = Buckets(audio_chunks=(1,), kv_lengths=(512,))
KINDS = ("none", "layers", "dflash", "ngram")
N_NEW = 24


@pytest.fixture(scope="module", autouse=True)
def inductor_cache(tmp_path_factory):
    """One fresh inductor cache for this module (rank workers inherit it): nothing an earlier run compiled
    answers here, and nothing here lands in the user's /tmp/torchinductor_*. One thread: on a shared 2-core
    machine a 2-thread OpenMP kernel waits at every barrier for a busy core (a tiny decode call measured 10x
    slower, eager and compiled alike), and kernels without OpenMP loops compile faster."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor_cache")))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    mp.undo()


def load(spec_dirs, kind, **kw):
    draft = {"layers": spec_dirs["layers_high"], "dflash": spec_dirs["dflash"]}.get(kind)
    k = 2 if kind in ("layers", "ngram") else None  # the same verify graph for both: one compile less
    return NxDVoxtralSpecDec.from_pretrained(spec_dirs["target"], draft=draft, draft_kind=None if kind == "none" else
                                             kind, num_speculative_tokens=k, buckets=B, **kw)


@pytest.fixture(scope="module")
def prompt(spec_dirs):
    m = load(spec_dirs, "none")
    return m.prepare(noise(3.0, seed=9), sampling_rate=16000)


@pytest.fixture(scope="module")
def eager_tokens(spec_dirs, prompt):
    out = {}
    for kind in KINDS:
        with load(spec_dirs, kind) as m:
            out[kind] = m.generate(prompt.input_ids, prompt.input_features, max_new_tokens=N_NEW)[0].tolist()
    return out


def dynamo_state() -> dict:
    return {"unique_graphs": counters["stats"]["unique_graphs"], "frames": counters["stats"]["calls_captured"],
            "graph_breaks": sum(counters["graph_break"].values()), "inductor": sum(counters["inductor"].values()),
            "aot": sum(counters["aot_autograd"].values())}


def generate_without_compiling(m, prompt) -> list[int]:
    """A whole generate with dynamo forbidden to compile anything new: every graph call hits the cache entry
    its (tag, bucket) got at load, and no counter of dynamo, AOT autograd or inductor moves."""
    before = dynamo_state()
    with torch._dynamo.config.patch(error_on_recompile=True):
        ids = m.generate(prompt.input_ids, prompt.input_features, max_new_tokens=N_NEW)[0].tolist()
    assert dynamo_state() == before
    return ids


def test_artifact_build_deploy_load_from_cache(spec_dirs, prompt, eager_tokens, tmp_path):
    out = tmp_path / "art"
    assert build_main(["--model", str(spec_dirs["target"]), "--backend", "inductor", "--buckets", "audio=1:kv=512",
                       "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["backend"] == "inductor" and manifest["versions"]["torch"] == torch.__version__
    assert manifest["compile"] == {"torch_compile_backend": "inductor", "device": "cpu", "cache_dir": "compile_cache"}
    assert {(g["tag"], g["bucket"]) for g in manifest["graphs"]} == {("audio_encoder", 1), ("context_encoding", 1),
                                                                    ("token_generation", 512)}
    assert all(g["inductor_compiles"] == 1 for g in manifest["graphs"])  # the build compiled each graph into the artifact
    cached = [f["path"] for f in manifest["files"] if f["path"].startswith("compile_cache/rank0/")]
    assert any(p.endswith(".so") for p in cached) and any("aotautograd" in p for p in cached)

    current = deploy(pack(out, tmp_path / "art.tar"), tmp_path / "fleet")
    released = sorted((f["path"], f["sha256"]) for f in manifest["files"])
    torch._dynamo.reset()  # as a fresh serving process: nothing compiled in memory
    torch.set_num_threads(2)  # built with 1 (this module): the cache does not depend on the thread count
    try:
        with NxDVoxtralSpecDec.from_artifacts(tmp_path / "fleet" / "current") as m:
            s = summary(m.compile_stats)
            # every graph traced again by dynamo, its compiled code taken from the artifact's cache, none recompiled
            assert (s["graphs"], s["traced"], s["aot_cache_hits"], s["inductor_compiles"]) == (3, 3, 3, 0)
            assert all(isinstance(g, CompiledGraph) for g in m.engine.graphs.values())
            assert generate_without_compiling(m, prompt) == eager_tokens["none"]
    finally:
        torch.set_num_threads(1)  # (dynamo guards on it: the tp 1 tests below compile their own entries)
    # the release was read, not written (the cache is compiled from a private copy)
    again = json.loads((current / "manifest.json").read_text())
    assert sorted((f["path"], f["sha256"]) for f in again["files"]) == released
    assert sorted(str(p.relative_to(current)) for p in current.rglob("*") if p.is_file()) == \
        sorted([p for p, _ in released] + ["manifest.json"])


def test_artifact_from_another_torch_is_refused(spec_dirs, tmp_path):
    """Cheap: the check runs before any weight is loaded. The manifest of a compiled build, other torch."""
    d = tmp_path / "art"
    d.mkdir()
    manifest = {"schema_version": SCHEMA_VERSION, "backend": "inductor", "tp": 1, "files": [], "weights": {},
                "versions": {"torch": "0.0-other", "neuron": {}},
                "compile": {"torch_compile_backend": "inductor", "device": "cpu", "cache_dir": "compile_cache"}}
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="inductor artifacts are tied to the torch version"):
        NxDVoxtralSpecDec.from_artifacts(d)
    manifest["versions"]["torch"] = torch.__version__
    manifest["compile"]["torch_compile_backend"] = "neuron"
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="built for torch.compile backend 'neuron', backend 'inductor' "
                                            "compiles with 'inductor'"):
        NxDVoxtralSpecDec.from_artifacts(d)


@pytest.mark.parametrize("kind", KINDS)
def test_tokens_equal_eager_no_graph_break_no_recompile(spec_dirs, prompt, eager_tokens, kind):
    breaks = sum(counters["graph_break"].values())
    m = load(spec_dirs, kind, backend="inductor")
    caches = m.engine.caches()
    where = {name: c.data_ptr() for name, c in caches.items()}
    assert sum(counters["graph_break"].values()) == breaks  # fullgraph=True would have raised anyway
    assert {(r["tag"], r["bucket"], r["batch"]) for r in m.compile_stats} == set(m.engine.graphs)
    assert all(isinstance(g, CompiledGraph) for g in m.engine.graphs.values())
    assert generate_without_compiling(m, prompt) == eager_tokens[kind]
    # KV caches stay in place: the same storage, written by the compiled graphs
    assert {name: c.data_ptr() for name, c in m.engine.caches().items()} == where
    assert all(c.abs().sum() > 0 for c in caches.values())
    assert generate_without_compiling(m, prompt) == eager_tokens[kind]  # and again: nothing left over


def test_tp2_compiled_tokens_equal_eager(spec_dirs, prompt, eager_tokens):
    with load(spec_dirs, "ngram", backend="inductor", tp_degree=2) as m:
        assert {(r["tag"], r["bucket"]) for r in m.compile_stats} == {
            ("audio_encoder", 1), ("context_encoding", 1), ("token_generation", 512), ("verify", 512)}
        assert m.generate(prompt.input_ids, prompt.input_features, max_new_tokens=N_NEW)[0].tolist() == \
            eager_tokens["ngram"]
        # every rank compiled its own graphs at load; a second pass over them finds every one in dynamo's cache
        again = [summary(r) for r in m.ranks.call("compile", INDUCTOR, None)]
        assert [(s["traced"], s["aot_cache_hits"], s["inductor_compiles"]) for s in again] == [(0, 0, 0)] * 2
