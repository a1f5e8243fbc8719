"""compile.build -> pack -> deploy -> from_artifacts generates what from_pretrained generates; every way an
artifact can be broken gives its typed error."""
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nxdi_voxtral.release import deploy, main as artifacts_main, pack, rollback
from nxdi_voxtral.build import build, main as build_main
from nxdi_voxtral import ArtifactError, Buckets, NxDVoxtralSpecDec
from nxdi_voxtral.contract import ContractViolation

from conftest import noise

B = Buckets(audio_chunks=(1,), kv_lengths=(512,))
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built(spec_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("art")
    d = spec_dirs
    layers = root / "layers_tp1"
    build(d["target"], layers, draft=d["layers_high"], draft_kind="layers", k=3, tp=1, buckets=B, pack_weights=True)
    ngram = root / "ngram_tp2"
    build(d["target"], ngram, draft_kind="ngram", k=2, tp=2, buckets=B)
    return {"layers": layers, "ngram": ngram, "root": root}


def reference(spec_dirs, kind, k):
    m = NxDVoxtralSpecDec.from_pretrained(spec_dirs["target"], draft=spec_dirs.get(f"{kind}_high"), draft_kind=kind,
                                          num_speculative_tokens=k, buckets=B)
    p = m.prepare(noise(3.0, seed=9), sampling_rate=16000)
    return p, m.generate(p.input_ids, p.input_features, max_new_tokens=30)[0].tolist()


def test_round_trip_build_pack_deploy_load(spec_dirs, built, tmp_path):
    p, ref = reference(spec_dirs, "layers", 3)
    tar = pack(built["layers"], tmp_path / "layers.tar")
    current = deploy(tar, tmp_path / "fleet")
    assert (tmp_path / "fleet" / "current").resolve() == current.resolve()
    manifest = json.loads((tmp_path / "fleet" / "current" / "manifest.json").read_text())
    assert manifest["tp"] == 1 and manifest["draft_kind"] == "layers" and manifest["weights"]["target"]["packed"]
    assert all(len(f["sha256"]) == 64 for f in manifest["files"])
    assert {(g["tag"], g["bucket"]) for g in manifest["graphs"]} >= {("verify", 512), ("draft_fused_k", 512)}
    with NxDVoxtralSpecDec.from_artifacts(tmp_path / "fleet" / "current") as m:
        assert m.generate(p.input_ids, p.input_features, max_new_tokens=30)[0].tolist() == ref
        assert type(m.engine.graphs[("verify", 512, 1)]).__name__ == "Program"  # the exported programs run


def test_tp2_artifact_with_external_weights(spec_dirs, built):
    p, ref = reference(spec_dirs, "ngram", 2)
    with NxDVoxtralSpecDec.from_artifacts(built["ngram"]) as m:
        assert m.generate(p.input_ids, p.input_features, max_new_tokens=30)[0].tolist() == ref
    with pytest.raises(ArtifactError, match="built for tp=2, tp_degree=1 requested"):
        NxDVoxtralSpecDec.from_artifacts(built["ngram"], tp_degree=1)


def broken_copy(src, dst, breaker):
    shutil.copytree(src, dst)
    breaker(dst)
    return dst


def flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# verify checks the files against the manifest: damaged files exit 2. A manifest edited to claim other versions
# or another backend verifies (its files are intact) and is refused when loading, on this host.
@pytest.mark.parametrize("breaker,match,verify_rc", [
    (lambda d: flip_byte(next((d / "graphs").glob("verify*"))), "verify.*sha256 mismatch", 2),
    (lambda d: (d / "weights/target/model.safetensors").write_bytes(b"x"), "model.safetensors is 1 bytes", 2),
    (lambda d: next((d / "graphs").glob("token_generation*")).unlink(), "missing file graphs/token_generation", 2),
    (lambda d: (d / "manifest.json").unlink(), "no manifest.json", 2),
    (lambda d: (d / "manifest.json").write_text(
        (d / "manifest.json").read_text().replace('"torch": "', '"torch": "0.0-other-')), "versions.torch", 0),
    (lambda d: (d / "manifest.json").write_text(
        (d / "manifest.json").read_text().replace('"backend": "export"', '"backend": "nxd"')), "backend", 0),
], ids=["graph_flipped_byte", "weights_truncated", "graph_missing", "manifest_missing", "other_torch_version",
        "other_backend"])
def test_broken_artifacts_give_typed_errors(built, tmp_path, breaker, match, verify_rc):
    d = broken_copy(built["layers"], tmp_path / "broken", breaker)
    with pytest.raises(ArtifactError, match=match):
        NxDVoxtralSpecDec.from_artifacts(d)
    assert artifacts_main(["verify", str(d)]) == verify_rc


def test_external_weights_changed_after_build(spec_dirs, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(spec_dirs["target"], target)
    out = tmp_path / "art"
    build(target, out, tp=1, buckets=B)
    flip_byte(target / "model.safetensors")
    with pytest.raises(ArtifactError, match="model.safetensors: sha256 mismatch"):
        NxDVoxtralSpecDec.from_artifacts(out)


def test_build_refuses_a_graph_that_breaks_the_contract(spec_dirs, tmp_path, monkeypatch):
    import torch
    from nxdi_voxtral import graphs
    orig = graphs.TokenGenerationGraph.forward

    def with_sort(self, token, position, cache_mask, slots):
        (tok,) = orig(self, token, position, cache_mask, slots)
        return (torch.sort(tok).values,)
    monkeypatch.setattr(graphs.TokenGenerationGraph, "forward", with_sort)
    with pytest.raises(ContractViolation, match=r"token_generation\[512\].*sort"):
        build(spec_dirs["target"], tmp_path / "bad", tp=1, buckets=B)
    assert not (tmp_path / "bad" / "manifest.json").exists()  # no manifest: never loadable


def test_interrupted_deploy_keeps_current_and_rollback(built, tmp_path):
    fleet = tmp_path / "fleet"
    v1 = deploy(pack(built["layers"], tmp_path / "v1.tar"), fleet)
    v2_tar = pack(built["ngram"], tmp_path / "v2.tar")
    # the deploy SIGKILLs itself (release.unpack's test hook) once the manifest and one more file are unpacked:
    # killed mid-copy, at the same point on any machine
    env = {**os.environ, "NXDI_VOXTRAL_DEPLOY_CRASH_AFTER": "2", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "artifacts", "deploy", str(v2_tar), "--to", str(fleet)], cwd=ROOT,
                          env=env, timeout=300)
    assert proc.returncode == -signal.SIGKILL
    (incoming,) = fleet.glob(".incoming-*")  # the half-copied release it left behind
    written = [str(p.relative_to(incoming)) for p in incoming.rglob("*") if p.is_file()]
    assert len(written) == 2 and "manifest.json" in written, written
    assert (fleet / "current").resolve() == v1.resolve()
    assert artifacts_main(["verify", str(fleet / "current")]) == 0
    v2 = deploy(v2_tar, fleet)  # cleans the stale incoming dir
    assert not list(fleet.glob(".incoming-*")) and (fleet / "current").resolve() == v2.resolve()
    assert rollback(fleet) == f"releases/{v1.name}" and (fleet / "current").resolve() == v1.resolve()
    # rollback walks back through the history (issue 13): v1 is the oldest, so a second one is refused
    assert artifacts_main(["deploy", "--to", str(fleet), "--rollback"]) == 2
    assert (fleet / "current").resolve() == v1.resolve()


def test_build_cli(spec_dirs, tmp_path, capsys):
    rc = build_main(["--model", str(spec_dirs["target"]), "--tp", "1", "--buckets", "audio=1:kv=512",
                     "--out", str(tmp_path / "cli"), "--backend", "export"])
    out = capsys.readouterr().out
    assert rc == 0 and "token_generation" in out and "graphs x 1 rank(s)" in out
    assert build_main(["--model", str(spec_dirs["target"]), "--out", str(tmp_path / "cli"), "--backend", "export",
                       "--buckets", "audio=1:kv=512"]) == 2  # refuses to overwrite
    assert build_main(["--model", str(spec_dirs["target"]), "--out", str(tmp_path / "n"), "--backend", "nxd",
                       "--buckets", "audio=1:kv=512"]) == 2  # no Neuron SDK here: a clear error
    assert "cannot build on this host" in capsys.readouterr().err
