"""The server as a fleet runs it: `python -m nxdi_voxtral serve --artifacts .../current` in a subprocess on a
loopback port, driven by real HTTP clients (the openai package, httpx). Every transcript is compared with the
Python API's on the same weights; hot swap goes through `artifacts deploy`; the tests end with SIGTERM.

No timer races: a test that acts on a request while it runs (a client that leaves, SIGTERM) holds it at a chosen
token through the server's test hook (nxdi_voxtral.serve.host.HoldForTests, NXDI_VOXTRAL_TEST_HOLD); admission
(queue full / queue timeout) needs the device held for as long as the test says: that test runs the same app (Host,
admission, middleware, uvicorn) in this process, where the model's generate can wait on an Event."""
import json
import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from nxdi_voxtral.release import deploy, main as artifacts_main, pack, switch_link
from nxdi_voxtral.build import build
from nxdi_voxtral import Buckets, NxDVoxtralSpecDec
from nxdi_voxtral.manifest import file_entries, weight_files, write_manifest
from nxdi_voxtral.synthetic import demo_dirs, write_random_checkpoint

from serve_helpers import Server, free_port, noise, sse_events, wav_bytes

B = Buckets(audio_chunks=(1,), kv_lengths=(512, 1024))
QUICK = 16    # tokens for most requests
LONG = 400    # the server's cap
HOLD_AT = 2   # the token at which a held request stops until the test releases it (or its client leaves)
CLIP = wav_bytes(noise(2.0, seed=3))


def with_weights(src: Path, dst: Path, weights_dir: Path) -> Path:
    """A second release of the same graphs with other weights (the CPU programs take the weights as their first
    argument, so this is what compile.build would write for that checkpoint): its transcripts differ, so a
    response that mixed versions would show."""
    shutil.copytree(src, dst)
    shutil.copy(weights_dir / "model.safetensors", dst / "weights/target/model.safetensors")
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["weights"]["target"]["files"] = file_entries(dst, weight_files(dst / "weights/target"))
    write_manifest(dst, manifest)
    return dst


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    demo = demo_dirs()
    build(demo["target"], root / "v1", tp=1, buckets=B, pack_weights=True)
    other = write_random_checkpoint(root / "other_weights", seed=7)
    v2 = with_weights(root / "v1", root / "v2", other)
    dest = root / "fleet"
    deploy(pack(root / "v1", root / "v1.tar"), dest)
    return {"root": root, "dest": dest, "v2_tar": pack(v2, root / "v2.tar"), "v1": root / "v1",
            "weights": {"v1": demo["target"], "v2": other}}


@pytest.fixture(scope="module")
def refs(fleet):
    """The Python API's transcripts of CLIP (QUICK tokens) with each release's weights."""
    out = {}
    for name, weights in fleet["weights"].items():
        m = NxDVoxtralSpecDec.from_pretrained(weights, buckets=B)
        out[name] = m.transcribe(noise(2.0, seed=3), sampling_rate=16000, max_new_tokens=QUICK).text
    assert out["v1"] != out["v2"]
    return out


class Hold:
    """The test's side of the server's HoldForTests hook (files in one directory): `arm()` makes the next request
    that starts stop after HOLD_AT accepted tokens, `wait_held()` returns once it has, `release()` lets it go on."""

    def __init__(self, root: Path):
        self.root = root

    def arm(self, at: int = HOLD_AT) -> None:
        for name in ("held", "release"):
            (self.root / name).unlink(missing_ok=True)
        (self.root / "armed.tmp").write_text(str(at))
        (self.root / "armed.tmp").rename(self.root / "armed")  # whole or absent, whenever the server looks

    def wait_held(self, server, timeout: float = 120) -> None:
        deadline = time.time() + timeout  # a bound on failure only: a request that is never held fails the test
        while not (self.root / "held").exists():
            assert time.time() < deadline and server.proc.poll() is None, server.log()[-3000:]
            time.sleep(0.01)
        assert not (self.root / "armed").exists()

    def release(self) -> None:
        (self.root / "release").touch()


@pytest.fixture(scope="module")
def server(fleet, tmp_path_factory):
    hold_dir = tmp_path_factory.mktemp("hold")
    s = Server(["--artifacts", str(fleet["dest"] / "current"), "--queue-depth", "2", "--queue-timeout", "30",
                "--max-upload-mb", "0.25", "--max-new-tokens", str(LONG), "--watch", "0", "--grace", "60"],
               tmp_path_factory.mktemp("log") / "server.log", env={"NXDI_VOXTRAL_TEST_HOLD": str(hold_dir)})
    s.hold = Hold(hold_dir)
    try:
        s.wait_ready()
        yield s
    finally:
        s.hold.release()  # a test that failed while a request was held must not keep the device past the grace
        s.stop()


def error_of(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_transcribe_matches_the_python_api(server, refs):
    r = server.transcribe(CLIP, model="voxtral-mini-3b", max_completion_tokens=QUICK)
    assert r.status_code == 200, r.text
    assert r.json()["text"] == refs["v1"] and r.headers["x-voxtral-version"] == server.health()["version"]
    t = server.transcribe(CLIP, response_format="text", max_completion_tokens=QUICK)
    assert t.headers["content-type"].startswith("text/plain") and t.text == refs["v1"]
    v = server.transcribe(CLIP, response_format="verbose_json", language="en", max_completion_tokens=QUICK).json()
    assert v["duration"] == pytest.approx(2.0) and v["language"] == "en" and v["tokens"] == QUICK
    assert v["speculation"]["target_passes"] == QUICK and v["timings"]["decode_s"] > 0


def test_openai_client(server, refs):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["voxtral-mini-3b"]
    r = client.audio.transcriptions.create(model="voxtral-mini-3b", file=("clip.wav", CLIP, "audio/wav"),
                                           extra_body={"max_completion_tokens": QUICK})
    assert r.text == refs["v1"]
    v = client.audio.transcriptions.create(model="voxtral-mini-3b", file=("clip.wav", CLIP, "audio/wav"),
                                           response_format="verbose_json", extra_body={"max_completion_tokens": QUICK})
    assert v.text == refs["v1"] and v.duration == pytest.approx(2.0)
    with pytest.raises(openai.UnprocessableEntityError, match="temperature"):
        client.audio.transcriptions.create(model="voxtral-mini-3b", file=("clip.wav", CLIP, "audio/wav"),
                                           temperature=0.7)


def stream(server, audio=CLIP, **fields):
    data = {"stream": "true", **{k: str(v) for k, v in fields.items()}}
    with server.client.stream("POST", "/v1/audio/transcriptions", files={"file": ("c.wav", audio, "audio/wav")},
                              data=data) as r:
        return r, sse_events(r.iter_lines())


def test_streaming_deltas_add_up_to_the_transcript(server, refs):
    r, events = stream(server, max_completion_tokens=QUICK, stream_include_usage="true")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]" and all(e["object"] == "transcription.chunk" for e in events[:-1])
    deltas = [e["choices"][0]["delta"]["content"] for e in events[:-3]]
    assert len(deltas) > 1 and "".join(deltas) == refs["v1"]
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == QUICK


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, refs):
    cases = [
        (server.transcribe(b"this is not audio at all"), 400, "invalid_audio", "file"),
        (server.transcribe(b""), 400, "invalid_audio", "file"),
        (server.transcribe(wav_bytes(np.full(16000, np.nan, np.float32), subtype="FLOAT")), 400, "invalid_audio",
         "file"),
        (server.transcribe(CLIP, language="xx"), 400, "invalid_language", "language"),
        (server.transcribe(wav_bytes(noise(10.0))), 413, "upload_too_large", "file"),           # 320 kB > 0.25 MiB
        (server.transcribe(wav_bytes(np.zeros(16000 * 40, np.float32), fmt="FLAC")), 413, "audio_too_long", "file"),
        (server.transcribe(CLIP, content_type="text/plain"), 415, "unsupported_media_type", "file"),
        (server.client.post("/v1/audio/transcriptions", json={"file": "x"}), 415, "unsupported_media_type", None),
        (server.transcribe(CLIP, temperature=0.2), 422, "unsupported_value", "temperature"),
        (server.transcribe(CLIP, response_format="srt"), 422, "invalid_value", "response_format"),
        (server.transcribe(CLIP, model="whisper-1"), 404, "model_not_found", "model"),
        (server.client.post("/v1/audio/transcriptions", files={"other": ("a", b"x")}), 400, "missing_field", "file"),
    ]
    for r, status, code, param in cases:
        err = error_of(r)
        assert (r.status_code, err["code"], err["param"]) == (status, code, param), err
    assert "30 s" in error_of(cases[5][0])["message"]  # names the largest audio bucket
    # a chunked upload (no Content-Length) is counted while it is read
    req = httpx.Request("POST", "http://x", files={"file": ("a.wav", wav_bytes(noise(10.0)), "audio/wav")})
    body = req.read()
    chunks = iter([body[i:i + 65536] for i in range(0, len(body), 65536)])
    r = server.client.post("/v1/audio/transcriptions", content=chunks,
                           headers={"content-type": req.headers["content-type"]})
    assert r.status_code == 413 and error_of(r)["code"] == "upload_too_large"
    assert server.transcribe(CLIP, max_completion_tokens=QUICK).json()["text"] == refs["v1"]


def multipart(**fields) -> tuple[bytes, dict]:
    """A transcription request's multipart body (CLIP as the file) and its headers, for a raw socket."""
    req = httpx.Request("POST", "http://x", files={"file": ("a.wav", CLIP, "audio/wav")},
                        data={k: str(v) for k, v in fields.items()})
    body = req.read()
    return body, {"content-type": req.headers["content-type"], "content-length": str(len(body))}


def raw_post(server, body: bytes, headers: dict, send_bytes: int, read=True, before_close=None) -> bytes:
    """Send only the first `send_bytes` of `body` on a raw socket (a truncated upload). read=False: close the
    connection without reading the reply, after calling `before_close()` if given (a client that leaves)."""
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(f"POST /v1/audio/transcriptions HTTP/1.1\r\nhost: x\r\n{head}\r\n".encode() + body[:send_bytes])
        if not read:
            if before_close:
                before_close()
            return b""
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(65536):  # until the server closes the connection
            reply += chunk
        return reply


def test_truncated_uploads(server, refs):
    body, headers = multipart(model="m")
    # the multipart body ends before its closing boundary, Content-Length consistent with what was sent
    cut = len(body) - 30
    reply = raw_post(server, body[:cut], {**headers, "content-length": str(cut)}, cut)
    assert reply.startswith(b"HTTP/1.1 400")
    err = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert (err["code"], err["param"]) == ("missing_field", "file")  # the unterminated part never completes
    # the client sends half of what Content-Length announced and closes the connection
    raw_post(server, body, headers, len(body) // 2, read=False)
    assert server.transcribe(CLIP, max_completion_tokens=QUICK).json()["text"] == refs["v1"]
    assert server.metric("voxtral_queue_depth") == 0 and server.metric("voxtral_running") == 0


class InProcessServer:
    """What `python -m nxdi_voxtral serve --artifacts DIR` runs (Host, create_app, the upload / metrics middleware,
    uvicorn), on a thread of this process, so that a test can reach into it. Same client helpers as Server."""
    transcribe, metrics, metric, health = Server.transcribe, Server.metrics, Server.metric, Server.health

    def __init__(self, artifacts: Path, queue_depth: int, queue_timeout_s: float, max_new_tokens: int):
        import uvicorn
        from nxdi_voxtral.serve.app import RequestMetrics, UploadGuard, create_app
        from nxdi_voxtral.serve.host import Host, Source
        from nxdi_voxtral.serve.metrics import Metrics
        metrics = Metrics()
        self.host = Host(Source("artifacts", str(artifacts)), metrics, max_new_tokens)
        self.host.loader.submit(self.host.start).result()  # on the loader thread, as serve does
        self.app = create_app(self.host, metrics, "voxtral-mini-3b", 2**20, queue_depth, queue_timeout_s,
                              on_shutdown=self.host.close)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(RequestMetrics(UploadGuard(self.app, 2**20), metrics),
                                                    host="127.0.0.1", port=self.port, lifespan="on",
                                                    log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.thread.start()
        deadline = time.time() + 120
        while not self.server.started:
            assert self.thread.is_alive() and time.time() < deadline, "in-process server did not start"
            time.sleep(0.05)
        self.client = httpx.Client(base_url=self.url, timeout=120)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(120)
        self.client.close()


def test_admission_queue_full_and_wait_timeout_get_503_with_retry_after(fleet, refs, monkeypatch):
    """One request runs, `queue_depth` 2 wait at most `queue_timeout_s`, the rest are refused at once. The running
    request holds the device until the test releases it, so which request gets what is fixed, not a race: B waits
    out the timeout; with the timeout then raised, C and D wait, E and F find the queue full."""
    on_device, release = threading.Event(), threading.Event()
    srv = InProcessServer(fleet["v1"], queue_depth=2, queue_timeout_s=0.3, max_new_tokens=LONG)
    try:
        model = srv.host.live.model
        real_generate = model.generate

        def held_generate(*args, **kwargs):
            on_device.set()
            assert release.wait(300), "the test never released the device"
            return real_generate(*args, **kwargs)
        monkeypatch.setattr(model, "generate", held_generate)
        results = {}

        def client(name):
            with httpx.Client(base_url=srv.url, timeout=300) as c:
                results[name] = srv.transcribe(CLIP, client=c, max_completion_tokens=QUICK)
        running = threading.Thread(target=client, args=("A",))
        running.start()
        assert on_device.wait(120), "request A never reached the device"
        client("B")  # waits 0.3 s for a device that stays busy
        srv.app.state.admission.timeout_s = 600  # from now on waiters stay until the device frees up
        waiting = [threading.Thread(target=client, args=(n,)) for n in ("C", "D")]
        for t in waiting:
            t.start()
        deadline = time.time() + 120
        while srv.metric("voxtral_queue_depth") < 2:
            assert time.time() < deadline and all(t.is_alive() for t in waiting), results
            time.sleep(0.02)
        client("E")
        client("F")
        release.set()
        for t in [running, *waiting]:
            t.join(300)
        codes = {n: (r.status_code, error_of(r)["code"] if r.status_code != 200 else "") for n, r in results.items()}
        assert codes == {"A": (200, ""), "B": (503, "queue_timeout"), "C": (200, ""), "D": (200, ""),
                         "E": (503, "queue_full"), "F": (503, "queue_full")}, codes
        assert all(results[n].json()["text"] == refs["v1"] for n in "ACD")
        assert all(int(results[n].headers["retry-after"]) >= 1 for n in "BEF")
        assert srv.metric("voxtral_queue_depth") == 0
        assert srv.metric("voxtral_rejected_total", reason="queue_full") == 2
        assert srv.metric("voxtral_rejected_total", reason="queue_timeout") == 1
    finally:
        release.set()
        srv.stop()


def wait_metric(server, name: str, value: float, timeout: float = 120) -> None:
    deadline = time.time() + timeout  # a bound on failure only
    while server.metric(name) != value:
        assert time.time() < deadline, f"{name} = {server.metric(name)}, expected {value}"
        time.sleep(0.02)


def test_a_client_that_disconnects_frees_its_slot(server, refs):
    """Each request is held at token HOLD_AT (of QUICK) until its client has gone, so the client always leaves
    mid-generation: the generation stops (voxtral_cancelled_total; no tokens counted as generated), the device slot
    is freed (the next request is served at once: were the slot kept, it would wait out the 30 s queue timeout and
    get a 503)."""
    before, tokens = server.metric("voxtral_cancelled_total"), server.metric("voxtral_tokens_generated_total")
    # a streaming client that leaves after the first delta
    server.hold.arm()
    with httpx.Client(base_url=server.url, timeout=120) as c:
        with c.stream("POST", "/v1/audio/transcriptions", files={"file": ("c.wav", CLIP, "audio/wav")},
                      data={"stream": "true", "max_completion_tokens": str(QUICK)}) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
            assert json.loads(first[len("data: "):])["choices"][0]["delta"]["content"]
    # closed: the server notices while the request is held (or before it gets there; the test never releases it)
    wait_metric(server, "voxtral_cancelled_total", before + 1)
    # a non-streaming client that leaves while its request is on the device
    server.hold.arm()
    body, headers = multipart(max_completion_tokens=QUICK)
    # sent whole; the connection is closed once the request is held on the device (and it is never released)
    raw_post(server, body, headers, len(body), read=False, before_close=lambda: server.hold.wait_held(server))
    wait_metric(server, "voxtral_cancelled_total", before + 2)
    assert server.transcribe(CLIP, max_completion_tokens=QUICK).json()["text"] == refs["v1"]
    assert server.metric("voxtral_tokens_generated_total") == tokens + QUICK  # the last request's only
    assert server.metric("voxtral_queue_depth") == 0 and server.metric("voxtral_running") == 0


def wait_swap(server, previous: dict, timeout=180) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        last = server.health()["last_swap"]
        if last != previous:
            return last
        time.sleep(0.2)
    raise TimeoutError(server.log()[-3000:])


def test_hot_swap_under_traffic_rollback_and_refused_versions(server, fleet, refs):
    dest, v1_id = fleet["dest"], server.health()["version"]
    seen, stop = [], threading.Event()

    def traffic():
        with httpx.Client(base_url=server.url, timeout=120) as c:
            while not stop.is_set() and len(seen) < 200:
                r = server.transcribe(CLIP, client=c, max_completion_tokens=QUICK)
                seen.append((r.status_code, r.headers.get("x-voxtral-version"), r.text))
    def wait_seen(version: str) -> None:
        deadline = time.time() + 120  # a bound on failure only
        while not any(v == version for _, v, _ in seen):
            assert time.time() < deadline and t.is_alive(), seen[-3:]
            time.sleep(0.02)
    t = threading.Thread(target=traffic)
    t.start()
    try:
        wait_seen(v1_id)  # traffic before the swap...
        assert artifacts_main(["deploy", str(fleet["v2_tar"]), "--to", str(dest)]) == 0
        server.proc.send_signal(signal.SIGHUP)
        swap = wait_swap(server, {})
        if swap["result"] == "ok":
            wait_seen(swap["version"])  # ...and after it
    finally:
        stop.set()
        t.join()
    assert swap["result"] == "ok" and swap["previous"] == v1_id, swap
    v2_id = swap["version"]
    assert server.health()["version"] == v2_id
    expected = {v1_id: refs["v1"], v2_id: refs["v2"]}
    assert all(code == 200 for code, _, _ in seen) and {v for _, v, _ in seen} == {v1_id, v2_id}
    assert all(json.loads(text)["text"] == expected[v] for _, v, text in seen)  # none mixed
    assert server.metric("voxtral_artifact_info", version=v2_id, path=swap["path"], source="artifacts") == 1

    # a release that fails verification (a flipped byte) and one that verifies but fails warm-up (a graph program
    # for the wrong bucket): both refused, v2 stays live and keeps serving
    bad = fleet["root"] / "bad_hash"
    shutil.copytree(fleet["v1"], bad)
    data = bytearray((bad / "graphs/token_generation.1024.rank0.pt2").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / "graphs/token_generation.1024.rank0.pt2").write_bytes(bytes(data))
    bad_warm = fleet["root"] / "bad_warm"
    shutil.copytree(fleet["v1"], bad_warm)
    shutil.copy(bad_warm / "graphs/token_generation.512.rank0.pt2", bad_warm / "graphs/token_generation.1024.rank0.pt2")
    write_manifest(bad_warm, json.loads((bad_warm / "manifest.json").read_text()))
    assert artifacts_main(["verify", str(bad_warm)]) == 0
    previous_link = os.readlink(dest / "current")
    for broken, match in ((bad, "sha256 mismatch"), (bad_warm, "shape")):
        switch_link(dest, "current", str(broken))
        before = server.health()["last_swap"]
        server.proc.send_signal(signal.SIGHUP)
        refused = wait_swap(server, before)
        assert refused["result"] == "refused" and match in refused["error"], refused
        assert server.health()["version"] == v2_id
        assert server.transcribe(CLIP, max_completion_tokens=QUICK).json()["text"] == refs["v2"]
    assert server.metric("voxtral_swaps_total", result="refused") == 2
    switch_link(dest, "current", previous_link)

    # `artifacts deploy --rollback` goes through the same path
    assert artifacts_main(["deploy", "--to", str(dest), "--rollback"]) == 0
    before = server.health()["last_swap"]
    server.proc.send_signal(signal.SIGHUP)
    back = wait_swap(server, before)
    assert back["result"] == "ok" and back["version"] == v1_id
    assert server.transcribe(CLIP, max_completion_tokens=QUICK).json()["text"] == refs["v1"]


def test_sigterm_finishes_the_request_in_flight_then_exits(server, refs):
    """A streaming request is held on the device (so certainly in flight) when SIGTERM arrives, and released only
    once uvicorn says it waits for the open connections: it then completes whole, and the process exits 0."""
    done = {}

    def request():
        done["r"], done["events"] = stream(server, max_completion_tokens=QUICK)
    server.hold.arm()
    t = threading.Thread(target=request)
    t.start()
    server.hold.wait_held(server)
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.time() + 60  # a bound on failure only
    while "Waiting for connections to close" not in server.log():
        assert time.time() < deadline and t.is_alive(), server.log()[-3000:]
        time.sleep(0.02)
    with pytest.raises(httpx.ConnectError):  # no longer accepting
        httpx.get(server.url + "/health/live", timeout=5)
    server.hold.release()
    t.join(120)
    events = done["events"]
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["delta"]["content"] for e in events[:-2]) == refs["v1"]  # whole, not cut short
    assert server.proc.wait(60) == 0
    assert "stopped" in server.log()


def test_an_upload_is_measured_from_its_header_and_not_decoded_before_admission(monkeypatch):
    """10 minutes of silence is a few KB of FLAC: its length is read from the header (no block decoded), so a
    too-long upload is refused with 413 before admission and before any decoding (the server test above)."""
    import soundfile as sf
    from nxdi_voxtral.serve.app import ApiError, upload_seconds
    data = wav_bytes(np.zeros(16000 * 600, np.float32), fmt="FLAC")
    assert len(data) < 200_000
    for name in ("read", "blocks"):
        monkeypatch.setattr(sf.SoundFile, name, lambda *a, **k: pytest.fail("decoded"))
    assert upload_seconds(data) == 600.0
    with pytest.raises(ApiError, match="empty"):
        upload_seconds(b"")
    with pytest.raises(ApiError, match="not readable audio"):
        upload_seconds(b"RIFF but not really a wav file")
