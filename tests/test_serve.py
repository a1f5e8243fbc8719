"""The server as a fleet runs it: `python -m nxdi_voxtral serve --artifacts .../current` in a subprocess on a
loopback port, driven by real HTTP clients (the openai package, httpx). Every transcript is compared with the
Python API's on the same weights; hot swap goes through `artifacts deploy`; the tests end with SIGTERM. A second
server (`--model`, `--max-batch 4`) runs the continuous-batching tests: each of its transcripts must equal what the
first (`--max-batch 1`) gives the same request alone; a long upload, whose windows run as sequences of its batch,
must get the Python API's `transcribe` of the same file.

No timer races: a test that acts on a request while it runs (a client that leaves, a request that joins, a swap,
SIGTERM) holds it at a chosen token through the server's test hook (nxdi_voxtral.serve.host.HoldForTests,
NXDI_VOXTRAL_TEST_HOLD), which pauses the whole batch between two steps; admission (queue full / queue timeout)
needs the device held for as long as the test says: that test runs the same app (Host, admission, middleware,
uvicorn) in this process, where the model's prefill can wait on an Event."""
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

from serve_helpers import Server, free_port, noise, speech_like, sse_events, wav_bytes

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
                "--max-upload-mb", "0.25", "--max-new-tokens", str(LONG), "--max-audio-s", "60", "--watch", "0",
                "--grace", "60"],
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
    assert [(seg["id"], seg["start"], seg["end"], seg["text"], len(seg["tokens"])) for seg in v["segments"]] == [
        (0, 0.0, v["duration"], v["text"], QUICK)]  # audio within one window: one segment covering it
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
    # longer than --max-audio-s (60 s here): measured from the header (a unit test below shows that no sample is
    # decoded for it) and refused before admission, so it never reaches the device
    admitted = server.metric("voxtral_queue_wait_seconds_count")
    r = server.transcribe(wav_bytes(np.zeros(16000 * 61, np.float32), fmt="FLAC"))
    assert r.status_code == 413 and (error_of(r)["code"], error_of(r)["param"]) == ("audio_too_long", "file")
    assert "60 s" in error_of(r)["message"] and "--max-audio-s" in error_of(r)["message"]
    assert server.metric("voxtral_queue_wait_seconds_count") == admitted
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
        real_start = model.start

        def held_start(*args, **kwargs):  # A's prefill waits for the test: A keeps the one device slot meanwhile
            on_device.set()
            assert release.wait(300), "the test never released the device"
            return real_start(*args, **kwargs)
        monkeypatch.setattr(model, "start", held_start)
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


# ---------------------------------------------------------------- continuous batching (--max-batch)

# (audio, max_completion_tokens, stream): other clips, caps and modes, so that the sequences stop at different steps
BATCH = [(CLIP, QUICK, True), (wav_bytes(noise(1.0, seed=4)), 24, False), (wav_bytes(noise(3.0, seed=5)), 12, True),
         (wav_bytes(noise(2.5, seed=6)), 20, False)]


def outcome(server, audio: bytes, tokens: int, stream: bool):
    """What a client sees of one request, on its own connection: the streamed deltas and finish reason, or the
    verbose_json text, token count and finish reason."""
    with httpx.Client(base_url=server.url, timeout=120) as c:
        if not stream:
            v = server.transcribe(audio, client=c, response_format="verbose_json", max_completion_tokens=tokens)
            assert v.status_code == 200, v.text
            return v.json()["text"], v.json()["tokens"], v.json()["finish_reason"]
        with c.stream("POST", "/v1/audio/transcriptions", files={"file": ("c.wav", audio, "audio/wav")},
                      data={"stream": "true", "max_completion_tokens": str(tokens)}) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]"
        return [e["choices"][0]["delta"]["content"] for e in events[:-2]], events[-2]["choices"][0]["finish_reason"]


class Clients:
    """Requests on threads, each on its own connection; `results()` joins them, in the order they were started."""

    def __init__(self, server):
        self.server, self.threads, self.out = server, [], {}

    def start(self, i: int, request) -> None:
        t = threading.Thread(target=lambda: self.out.__setitem__(i, outcome(self.server, *request)))
        t.start()
        self.threads.append((i, t))

    def results(self) -> list:
        for _, t in self.threads:
            t.join(120)
        return [self.out.get(i) for i, _ in self.threads]


@pytest.fixture(scope="module")
def one_at_a_time(server):
    """BATCH served one request after the other by the --max-batch 1 server (the fleet's v1)."""
    return [outcome(server, *request) for request in BATCH]


@pytest.fixture(scope="module")
def batch_server(tmp_path_factory):
    """The fleet's v1 weights (a copy of the demo target checkpoint), up to four sequences stepped together."""
    hold_dir, model_dir = tmp_path_factory.mktemp("batch_hold"), tmp_path_factory.mktemp("batch_model") / "target"
    shutil.copytree(demo_dirs()["target"], model_dir)
    s = Server(["--model", str(model_dir), "--buckets", "audio=1:kv=512,1024", "--max-batch", "4",
                "--queue-depth", "4", "--max-new-tokens", str(LONG)],
               tmp_path_factory.mktemp("log") / "batch_server.log", env={"NXDI_VOXTRAL_TEST_HOLD": str(hold_dir)})
    s.hold, s.model_dir = Hold(hold_dir), model_dir
    try:
        s.wait_ready()
        yield s
    finally:
        s.hold.release()
        s.stop()


def wait_batch(server, timeout: float = 120, **expected) -> None:
    """Until /health's batch block shows `expected` (e.g. waiting=2)."""
    deadline = time.time() + timeout  # a bound on failure only
    while {k: server.health()["batch"][k] for k in expected} != expected:
        assert time.time() < deadline and server.proc.poll() is None, (server.health()["batch"], expected)
        time.sleep(0.01)


def test_concurrent_requests_get_their_one_at_a_time_transcripts(batch_server, one_at_a_time):
    """Sent together to the --max-batch 4 server, however they happen to overlap, the requests get exactly what the
    --max-batch 1 server gives each alone: the same texts, token counts and streamed deltas."""
    clients = Clients(batch_server)
    for i, request in enumerate(BATCH):
        clients.start(i, request)
    assert clients.results() == one_at_a_time


def test_requests_that_join_mid_generation_get_their_exact_transcripts(batch_server, one_at_a_time):
    """The first request is held at its token HOLD_AT while the other three queue behind it, in order; released,
    they join the batch at the next step boundaries (one prefill per step while it runs) and every one gets its
    one-at-a-time transcript. The metrics show the overlap."""
    s = batch_server
    steps, stepped = s.metric("voxtral_batch_occupancy_count"), s.metric("voxtral_batch_occupancy_sum")
    waits = s.metric("voxtral_queue_wait_seconds_count")
    s.hold.arm()
    clients = Clients(s)
    clients.start(0, BATCH[0])
    s.hold.wait_held(s)
    for i in (1, 2, 3):
        clients.start(i, BATCH[i])
        wait_batch(s, waiting=i, running=1)
    s.hold.release()
    assert clients.results() == one_at_a_time
    assert (s.metric("voxtral_batch_occupancy_sum") - stepped) / (s.metric("voxtral_batch_occupancy_count") - steps) > 1
    assert s.metric("voxtral_queue_wait_seconds_count") == waits + 4
    assert s.metric("voxtral_max_batch") == 4 and s.metric("voxtral_generated_tokens_per_second") > 0
    batch = s.health()["batch"]
    assert batch["occupancy_mean"] > 1 and batch["tokens_per_s"] > 0
    assert batch["queue_wait_s"]["max"] >= batch["queue_wait_s"]["p50"] >= 0
    assert {k: batch[k] for k in ("max_batch", "running", "waiting", "kv_slots", "free_kv_slots")} == {
        "max_batch": 4, "running": 0, "waiting": 0, "kv_slots": 4, "free_kv_slots": 4}


def test_a_request_cancelled_mid_batch_frees_its_slot_and_the_others_finish_exactly(batch_server, one_at_a_time):
    """B is held at its token HOLD_AT while A (streaming) and C queue; released, A and C join B mid-generation, and A
    is held in turn at token HOLD_AT + 1 (C joined meanwhile). A's client leaves there: A's sequence leaves the
    batch at the next step (cancelled, none of its tokens counted), B and C finish exactly, every slot is free."""
    s = batch_server
    cancelled, tokens = s.metric("voxtral_cancelled_total"), s.metric("voxtral_tokens_generated_total")

    def leave_mid_stream():
        with httpx.Client(base_url=s.url, timeout=120) as c:
            with c.stream("POST", "/v1/audio/transcriptions", files={"file": ("a.wav", CLIP, "audio/wav")},
                          data={"stream": "true", "max_completion_tokens": str(LONG)}) as r:
                assert r.status_code == 200
                s.hold.wait_held(s)  # A is held in the batch beside B and C: leave now
    s.hold.arm()
    clients = Clients(s)
    clients.start(1, BATCH[1])                          # B
    s.hold.wait_held(s)
    leaving = threading.Thread(target=leave_mid_stream)  # A
    leaving.start()
    wait_batch(s, waiting=1)
    clients.start(3, BATCH[3])                          # C
    wait_batch(s, waiting=2)
    s.hold.arm(HOLD_AT + 1)  # taken by A, the next request to start
    s.hold.release()
    leaving.join(120)
    assert clients.results() == [one_at_a_time[1], one_at_a_time[3]]
    assert s.metric("voxtral_cancelled_total") == cancelled + 1
    assert s.metric("voxtral_tokens_generated_total") == tokens + one_at_a_time[1][1] + one_at_a_time[3][1]
    wait_batch(s, running=0, waiting=0, free_kv_slots=4)
    assert s.metric("voxtral_running") == 0 and s.metric("voxtral_queue_depth") == 0


def test_a_swap_lets_the_batch_finish_on_the_old_version(batch_server, one_at_a_time):
    """A and B are held mid-generation in the batch when SIGHUP loads a new version (the checkpoint touched: same
    weights, a new version id). Its switch waits for the batch to drain and C, arriving meanwhile, waits for it: A
    and B finish on the old version, C runs on the new one, every transcript exact."""
    s = batch_server
    old, previous_swap, seen = s.health()["version"], s.health()["last_swap"], {}

    def ask(name: str, i: int) -> None:
        audio, tokens, _ = BATCH[i]
        with httpx.Client(base_url=s.url, timeout=120) as c:
            r = s.transcribe(audio, client=c, max_completion_tokens=tokens)
        seen[name] = (r.headers.get("x-voxtral-version"), r.json().get("text"))
    threads = {name: threading.Thread(target=ask, args=(name, i)) for name, i in (("A", 1), ("B", 3), ("C", 0))}
    s.hold.arm()
    threads["A"].start()
    s.hold.wait_held(s)
    threads["B"].start()
    wait_batch(s, waiting=1)
    s.hold.arm(HOLD_AT + 1)  # B, held beside A
    s.hold.release()
    s.hold.wait_held(s)
    for weights in s.model_dir.glob("*.safetensors"):
        os.utime(weights)
    s.proc.send_signal(signal.SIGHUP)
    wait_batch(s, swap_pending=True, running=2)
    threads["C"].start()
    wait_batch(s, waiting=1)
    s.hold.release()
    for t in threads.values():
        t.join(120)
    swap = wait_swap(s, previous_swap)
    assert swap["result"] == "ok" and swap["previous"] == old, swap
    assert seen == {"A": (old, one_at_a_time[1][0]), "B": (old, one_at_a_time[3][0]),
                    "C": (swap["version"], "".join(one_at_a_time[0][0]))}  # BATCH[0] streamed its deltas


# ---------------------------------------------------------------- long uploads: windows in the batch

LONG_S = 120.0      # five windows of at most 29 s (the 30 s audio bucket less a second): more than --max-batch
WINDOW_TOKENS = 12  # max_completion_tokens, per window
LONG_AUDIO = speech_like(LONG_S, seed=2)
LONG_UPLOAD = wav_bytes(LONG_AUDIO)


@pytest.fixture(scope="module")
def long_reference(batch_server):
    """The Python API's transcription of LONG_UPLOAD with batch_server's weights and buckets."""
    m = NxDVoxtralSpecDec.from_pretrained(batch_server.model_dir, buckets=B, max_batch_size=4)
    ref = m.transcribe(LONG_UPLOAD, max_new_tokens=WINDOW_TOKENS)
    assert len(ref.segments) == 5 and all(len(seg.token_ids) > 1 for seg in ref.segments)
    return ref


def test_a_long_upload_runs_its_windows_in_the_batch_and_gets_the_python_api_transcript(batch_server,
                                                                                     long_reference):
    """Two minutes over the 30 s audio bucket: cut into the windows NxDVoxtralSpecDec.transcribe cuts, run as
    sequences of the batch (several at once, as the occupancy shows; the fifth joins as a slot frees up): the text,
    the segments and the stream are the Python API's."""
    s, ref = batch_server, long_reference
    steps, stepped = s.metric("voxtral_batch_occupancy_count"), s.metric("voxtral_batch_occupancy_sum")
    v = s.transcribe(LONG_UPLOAD, response_format="verbose_json", max_completion_tokens=WINDOW_TOKENS)
    assert v.status_code == 200, v.text
    body = v.json()
    assert body["text"] == ref.text and body["duration"] == LONG_S and body["tokens"] == len(ref.token_ids)
    assert [(seg["id"], seg["start"], seg["end"], seg["text"], seg["tokens"]) for seg in body["segments"]] == [
        (i, seg.start, seg.end, seg.text, seg.token_ids) for i, seg in enumerate(ref.segments)]
    assert (s.metric("voxtral_batch_occupancy_sum") - stepped) / (s.metric("voxtral_batch_occupancy_count") - steps) > 1
    assert s.transcribe(LONG_UPLOAD, max_completion_tokens=WINDOW_TOKENS).json()["text"] == ref.text
    assert s.transcribe(LONG_UPLOAD, response_format="text", max_completion_tokens=WINDOW_TOKENS).text == ref.text
    deltas, finish = outcome(s, LONG_UPLOAD, WINDOW_TOKENS, True)
    assert "".join(deltas) == ref.text and finish == body["finish_reason"]
    wait_batch(s, running=0, waiting=0, free_kv_slots=4)


def test_a_long_upload_whose_client_leaves_frees_all_its_slots(batch_server, one_at_a_time):
    """A long streaming upload fills the idle batch with its first four windows; held there, its client leaves:
    all four sequences leave the batch at the next step (one request cancelled), and the next request is exact."""
    s = batch_server
    cancelled = s.metric("voxtral_cancelled_total")
    s.hold.arm()
    with httpx.Client(base_url=s.url, timeout=120) as c:
        with c.stream("POST", "/v1/audio/transcriptions", files={"file": ("long.wav", LONG_UPLOAD, "audio/wav")},
                      data={"stream": "true", "max_completion_tokens": str(WINDOW_TOKENS)}) as r:
            assert r.status_code == 200
            s.hold.wait_held(s)
            assert s.health()["batch"]["running"] == 4  # one request, four windows stepped together
    wait_metric(s, "voxtral_cancelled_total", cancelled + 1)
    wait_batch(s, running=0, waiting=0, free_kv_slots=4)
    assert outcome(s, *BATCH[1]) == one_at_a_time[1]


def test_a_long_upload_whose_window_fails_frees_all_its_slots(batch_server, long_reference, one_at_a_time):
    """A NaN in the middle of the fourth window: that window fails to decode once the first three are in the batch
    (the idle batch is filled at once), the request fails (400) and their slots are free again."""
    s, fourth = batch_server, long_reference.segments[3]
    audio = LONG_AUDIO.copy()
    audio[round((fourth.start + fourth.end) / 2 * 16000)] = np.nan
    r = s.transcribe(wav_bytes(audio, subtype="FLOAT"), max_completion_tokens=WINDOW_TOKENS)
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_audio" and "NaN" in error_of(r)["message"]
    wait_batch(s, running=0, waiting=0, free_kv_slots=4)
    assert outcome(s, *BATCH[1]) == one_at_a_time[1]


def test_max_batch_beyond_the_release_kv_slots_is_a_startup_error(fleet, tmp_path):
    """A release built with one KV slot cannot serve two sequences at once: the server says so and how to rebuild,
    and exits 1 (it bound its port first: the model is loaded behind /health/live). --max-batch 0 fails at once."""
    import argparse
    from nxdi_voxtral.errors import ConfigError
    from nxdi_voxtral.serve.cli import add_arguments, serve
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ConfigError, match="--max-batch must be >= 1"):
        serve(parser.parse_args(["--max-batch", "0"]))
    s = Server(["--artifacts", str(fleet["v1"]), "--max-batch", "2"], tmp_path / "server.log")
    try:
        assert s.proc.wait(120) == 1
    finally:
        s.stop()
    log = s.log()
    assert "start-up failed: ConfigError: --max-batch 2 needs 2 KV slots" in log, log[-3000:]
    assert "--buckets ...:batch=1,2" in log and "max_batch_size=2" in log


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
