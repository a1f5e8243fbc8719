"""Deploy and build tools under misuse (issue 13, items 2, 3, 5 and the should-fix list): concurrent deploys,
rollback onto a broken release, a rollback history, unlisted files, leftovers of failed deploys / builds, and
build arguments refused before any work starts. Artifacts here are small fakes: verify() only reads the manifest
and the files it lists."""
import fcntl
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from nxdi_voxtral.release import deploy, main as artifacts_main, pack, rollback
from nxdi_voxtral.build import main as build_main, parse_buckets
from nxdi_voxtral.errors import ArtifactError, ConfigError
from nxdi_voxtral.manifest import SCHEMA_VERSION
from nxdi_voxtral.manifest import write_manifest

ROOT = Path(__file__).resolve().parents[1]


def fake_artifact(root: Path, name: str, payload: bytes) -> Path:
    d = root / name
    (d / "graphs").mkdir(parents=True)
    (d / "graphs" / "g.pt2").write_bytes(payload)
    write_manifest(d, {"schema_version": SCHEMA_VERSION, "backend": "export", "tp": 1, "graphs": [], "weights": {}})
    return d


@pytest.fixture
def tars(tmp_path):
    return [pack(fake_artifact(tmp_path, f"a{i}", f"release {i}".encode() * 50), tmp_path / f"a{i}.tar")
            for i in range(4)]


def current_payload(fleet: Path) -> bytes:
    return (fleet / "current" / "graphs" / "g.pt2").read_bytes()


def test_concurrent_deploys_both_succeed_in_order(tars, tmp_path):
    fleet = tmp_path / "fleet"
    deploy(tars[0], fleet)
    env = {**os.environ, "NXDI_VOXTRAL_DEPLOY_SLOW": "0.3", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-m", "artifacts", "deploy", str(t), "--to", str(fleet)], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for t in tars[1:3]]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert artifacts_main(["verify", str(fleet / "current")]) == 0
    assert (fleet / "previous").is_symlink() and artifacts_main(["verify", str(fleet / "previous")]) == 0
    assert not list(fleet.glob(".incoming-*")) and not list(fleet.glob(".current.*"))
    history = json.loads((fleet / "history.json").read_text())
    assert len(history) == 3 and (fleet / "current").resolve().name == history[-1]


def test_busy_destination_fails_clearly_after_waiting(tars, tmp_path):
    fleet = tmp_path / "fleet"
    deploy(tars[0], fleet)
    with open(fleet / ".deploy.lock", "a+") as held:  # another deploy in progress
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(ArtifactError, match="busy"):
            deploy(tars[1], fleet, wait_s=0.3)
    assert current_payload(fleet).startswith(b"release 0") and not list(fleet.glob(".incoming-*"))


def test_rollback_walks_back_and_refuses_a_broken_release(tars, tmp_path):
    fleet = tmp_path / "fleet"
    for t in tars:
        deploy(t, fleet, keep=3)
    assert len(list((fleet / "releases").iterdir())) == 3  # the oldest was pruned
    assert current_payload(fleet).startswith(b"release 3")
    rollback(fleet)
    assert current_payload(fleet).startswith(b"release 2")
    rollback(fleet)  # a second rollback goes further back, not forward again
    assert current_payload(fleet).startswith(b"release 1")
    with pytest.raises(ArtifactError, match="no earlier release"):
        rollback(fleet)
    # corrupt the release rollback would go to: refused, current untouched
    deploy(tars[3], fleet)
    prev = (fleet / "previous").resolve()
    (prev / "graphs" / "g.pt2").write_bytes(b"x" * len((prev / "graphs" / "g.pt2").read_bytes()))
    with pytest.raises(ArtifactError, match="refusing to roll back.*sha256 mismatch"):
        rollback(fleet)
    assert current_payload(fleet).startswith(b"release 3")
    import shutil
    shutil.rmtree(prev)  # deleted outright: refused too
    assert artifacts_main(["deploy", "--to", str(fleet), "--rollback"]) == 2
    assert artifacts_main(["verify", str(fleet / "current")]) == 0


def test_deploy_refuses_unlisted_files_and_cleans_up(tars, tmp_path):
    extra = tmp_path / "extra.tar"
    with tarfile.open(tars[0]) as src, tarfile.open(extra, "w") as dst:
        for m in src:
            dst.addfile(m, src.extractfile(m))
        evil = tmp_path / "evil.sh"
        evil.write_text("echo hi")
        dst.add(evil, arcname="graphs/evil.sh")
    fleet = tmp_path / "fleet"
    with pytest.raises(ArtifactError, match="does not list.*graphs/evil.sh"):
        deploy(extra, fleet)
    assert not list(fleet.glob(".incoming-*")) and not (fleet / "current").exists()  # no partial leftovers


def test_deploy_and_pack_argument_errors(tars, tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert artifacts_main(["deploy", str(tars[0]), "--to", str(a_file)]) == 2
    assert "not a directory" in capsys.readouterr().err
    fleet = tmp_path / "fleet"
    (fleet / "current").mkdir(parents=True)  # someone copied a release in by hand
    assert artifacts_main(["deploy", str(tars[0]), "--to", str(fleet)]) == 2
    assert "not a link" in capsys.readouterr().err
    assert not list(fleet.glob(".current.*"))  # no link left behind
    assert artifacts_main(["pack", str(tmp_path / "a0"), "-o", str(tmp_path / "missing" / "x.tar")]) == 2
    assert "does not exist" in capsys.readouterr().err
    no_files = tmp_path / "nofiles"
    no_files.mkdir()
    (no_files / "manifest.json").write_text(json.dumps({"schema_version": SCHEMA_VERSION, "backend": "export"}))
    assert artifacts_main(["verify", str(no_files)]) == 2
    assert "field files is missing" in capsys.readouterr().err


def test_build_arguments_refused_before_work(tiny_dir, tmp_path, capsys):
    for text, match in [("audio", "has no '='"), ("audio=1:bogus=3", "unknown key 'bogus'"),
                        ("audio=2,1", "audio sizes must be positive and strictly increasing"),
                        ("kv=512,x", "not a comma-separated list")]:
        with pytest.raises(ConfigError, match=match):
            parse_buckets(text)
    base = ["--model", str(tiny_dir), "--backend", "export", "--buckets", "audio=1:kv=512"]
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert build_main(base + ["--out", str(a_file)]) == 2 and "not a directory" in capsys.readouterr().err
    assert build_main(base + ["--out", str(tmp_path / "o"), "--tp", "0"]) == 2
    assert "--tp must be a positive integer" in capsys.readouterr().err
    assert build_main(base + ["--out", str(tmp_path / "o3"), "--tp", "3"]) == 2  # 4 heads: refused, no rank started
    err = capsys.readouterr().err
    assert "must divide" in err and "rank" not in err.split("must divide")[0].lower()
    assert not (tmp_path / "o").exists() and not (tmp_path / "o3").exists()


def test_failed_build_leaves_nothing_and_force_replaces_only_builds(tiny_dir, tmp_path, capsys, monkeypatch):
    import nxdi_voxtral.build as cb
    out = tmp_path / "out"
    base = ["--model", str(tiny_dir), "--backend", "export", "--buckets", "audio=1:kv=512", "--out", str(out)]

    def fail_after_writing(*a, **k):
        (out / "graphs").mkdir(parents=True)
        (out / "graphs" / "half.pt2").write_bytes(b"half")
        raise ConfigError("simulated failure mid-build")
    monkeypatch.setattr(cb, "build", fail_after_writing)
    assert build_main(base) == 2
    assert not out.exists()  # the retry is not blocked by leftovers
    (out / "graphs").mkdir(parents=True)  # leftovers of a build killed with SIGKILL: refused, --force clears them
    (out / "graphs" / "half.pt2").write_bytes(b"half")
    monkeypatch.undo()
    assert build_main(base) == 2 and "--force" in capsys.readouterr().err
    monkeypatch.setattr(cb, "build", lambda *a, **k: (out.mkdir(), (out / "manifest.json").write_text("{}")))
    assert build_main(base + ["--force"]) == 0
    assert (out / "manifest.json").exists() and not (out / "graphs").exists()
    precious = tmp_path / "precious"
    (precious / "data").mkdir(parents=True)
    assert build_main(base[:-1] + [str(precious), "--force"]) == 2
    assert "refuses to delete" in capsys.readouterr().err and (precious / "data").exists()
