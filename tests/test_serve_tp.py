"""A tensor-parallel server (`python -m nxdi_voxtral serve --tp 2`, the embedded demo: no model arguments) whose
rank worker is SIGKILLed mid-request: that request fails with a clear error, readiness drops while the model is
reopened, then the server serves the same transcripts again; SIGTERM leaves no rank process behind."""
import os
import signal
import threading
import time

import pytest

from nxdi_voxtral import Buckets, NxDVoxtralSpecDec
from nxdi_voxtral.synthetic import demo_dirs

from serve_helpers import Server, noise, pid_alive, wav_bytes

CLIP = wav_bytes(noise(2.0, seed=3))


@pytest.fixture(scope="module")
def reference():
    m = NxDVoxtralSpecDec.from_pretrained(demo_dirs()["target"], buckets=Buckets((1,), (512, 1024)))
    return m.transcribe(noise(2.0, seed=3), sampling_rate=16000, max_new_tokens=16).text


def test_rank_worker_killed_mid_request_then_recovery_and_clean_exit(tmp_path, reference):
    s = Server(["--tp", "2", "--buckets", "audio=1:kv=512,1024", "--max-new-tokens", "400"], tmp_path / "tp.log")
    try:
        health = s.wait_ready()
        old_pids = health["rank_pids"]
        assert len(old_pids) == 2 and all(pid_alive(p) for p in old_pids)
        assert s.transcribe(CLIP, max_completion_tokens=16).json()["text"] == reference

        events = []
        with s.client.stream("POST", "/v1/audio/transcriptions", files={"file": ("c.wav", CLIP, "audio/wav")},
                             data={"stream": "true"}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and not events:
                    os.kill(old_pids[1], signal.SIGKILL)  # the first delta is out: the request is mid-generation
                if line:
                    events.append(line)
        error = next(e for e in events if '"error"' in e)
        assert '"code": "worker_died"' in error and "restart" in error and events[-1] == "data: [DONE]"
        assert s.client.get("/health/ready").status_code == 503  # dropped before the error reached the client
        s.wait_ready(timeout=300)
        health = s.health()
        assert health["state"] == "ready" and set(health["rank_pids"]).isdisjoint(old_pids)
        assert not any(pid_alive(p) for p in old_pids)
        assert s.transcribe(CLIP, max_completion_tokens=16).json()["text"] == reference
        assert s.metric("voxtral_worker_restarts_total") == 1

        # SIGTERM while a request runs: it completes, the process exits 0, its rank workers with it
        result = {}
        t = threading.Thread(target=lambda: result.update(r=s.transcribe(CLIP, max_completion_tokens=200)))
        t.start()
        deadline = time.time() + 60
        while s.metric("voxtral_running") == 0 and time.time() < deadline:
            time.sleep(0.02)
        pids = s.health()["rank_pids"]
        assert s.stop(signal.SIGTERM) == 0
        t.join(60)
        assert result["r"].status_code == 200 and len(result["r"].json()["text"]) > 0
        assert not any(pid_alive(p) for p in pids)
    finally:
        s.stop(signal.SIGKILL)
