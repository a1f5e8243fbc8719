"""The main job: python -m nxdi_voxtral transcribe AUDIO (embedded demo when no --model)."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import soundfile as sf

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, env_cache):
    import os
    env = {**os.environ, "NXDI_VOXTRAL_CACHE": str(env_cache)}
    return subprocess.run([sys.executable, "-m", "nxdi_voxtral", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_demo_transcribes_and_is_deterministic(tmp_path):
    r1 = run_cli("transcribe", "examples/chirp.wav", "--json", "--max-new-tokens", "12", env_cache=tmp_path / "a")
    assert r1.returncode == 0, r1.stderr
    assert "synthetic demo weights — transcript is meaningless" in r1.stderr
    r2 = run_cli("transcribe", "examples/chirp.wav", "--json", "--max-new-tokens", "12", env_cache=tmp_path / "b")
    out1, out2 = json.loads(r1.stdout), json.loads(r2.stdout)
    assert out1["token_ids"] == out2["token_ids"] and len(out1["token_ids"]) == 12  # same seed, same weights


def test_cli_reports_typed_errors(tmp_path, tiny_dir):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF....garbage")
    r = run_cli("transcribe", str(bad), "--model", str(tiny_dir), env_cache=tmp_path)
    assert r.returncode == 2 and "AudioError" in r.stderr and "cannot decode" in r.stderr
    r = run_cli("transcribe", "examples/chirp.wav", "--model", str(tmp_path / "nope"), env_cache=tmp_path)
    assert r.returncode == 2 and "CheckpointError" in r.stderr


def test_cli_with_model_dir(tmp_path, tiny_dir):
    wav = tmp_path / "x.wav"
    sf.write(wav, (np.random.RandomState(0).randn(16000) * 0.1).astype(np.float32), 16000)
    r = run_cli("transcribe", str(wav), "--model", str(tiny_dir), "--language", "en", "--max-new-tokens", "5",
                env_cache=tmp_path)
    assert r.returncode == 0, r.stderr


def test_demo_speculative_kinds_give_the_plain_transcript(tmp_path):
    args = ["transcribe", "examples/chirp.wav", "--json", "--max-new-tokens", "24"]
    plain = json.loads(run_cli(*args, env_cache=tmp_path).stdout)
    for extra in (["--draft-kind", "layers", "-k", "3"], ["--draft-kind", "dflash"], ["--draft-kind", "ngram"]):
        r = run_cli(*args, *extra, env_cache=tmp_path)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["token_ids"] == plain["token_ids"] and out["text"] == plain["text"]
        assert out["stats"]["draft_kind"] == extra[1]
    assert out["stats"]["draft_passes"] == 0  # n-gram runs on the host
