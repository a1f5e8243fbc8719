"""Load and fault benchmark of `python -m nxdi_voxtral serve` on loopback (bounded in requests and time).

Two tp-2 artifact releases of the demo model (v2: other weights, so every transcript tells which version made it)
are built, v1 is deployed and served; N closed-loop clients send three different clips for T seconds per phase:
  steady     N = capacity (1 running + --queue-depth waiting)
  overload   2 x capacity: the 503 rate
  hot swap   `python -m artifacts deploy v2.tar` a quarter into the phase; the server's link watcher swaps
  rank kill  SIGKILL of rank 1 while a request runs; readiness is sampled every 50 ms
Every response is checked: 200 with the Python API's transcript for (version in its header, clip) = ok; 200 with
any other text = mixed; an HTTP error = failed (by code); no HTTP response at all = lost. Clients honour
Retry-After (capped at 0.5 s).

    python -m benchmarks.serve_load [--clients 3] [--seconds 20] [--tokens 32] [--queue-depth 2]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import httpx  # noqa: E402

from benchmarks.common import markdown_table  # noqa: E402
from serve_helpers import Server, noise, pid_alive, wav_bytes  # noqa: E402

CLIPS = [noise(s, seed=10 + i) for i, s in enumerate((1.5, 2.5, 4.0))]
WAVS = [wav_bytes(c) for c in CLIPS]
MAX_REQUESTS_PER_PHASE = 2000


@contextlib.contextmanager
def stdout_to_stderr():
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def build_releases(root: Path, buckets):
    from nxdi_voxtral.release import pack
    from nxdi_voxtral.build import build
    from nxdi_voxtral.synthetic import demo_dirs, write_random_checkpoint
    weights = {"v1": demo_dirs()["target"], "v2": write_random_checkpoint(root / "v2_weights", seed=7)}
    tars = {}
    for name, w in weights.items():
        with stdout_to_stderr():  # stdout is for the table (the rank processes print too)
            build(w, root / name, tp=2, buckets=buckets, pack_weights=True)
        tars[name] = pack(root / name, root / f"{name}.tar")
    return weights, tars


def references(weights: dict, buckets, tokens: int) -> dict:
    """{manifest-hash version id: [text per clip]}: tp 2 generates the tokens tp 1 does (tests/test_tp.py)."""
    from nxdi_voxtral import NxDVoxtralSpecDec
    out = {}
    for name, w in weights.items():
        m = NxDVoxtralSpecDec.from_pretrained(w, buckets=buckets)
        out[name] = [m.transcribe(c, sampling_rate=16000, max_new_tokens=tokens).text for c in CLIPS]
    return out


class Phase:
    def __init__(self, name: str, clients: int):
        self.name, self.clients = name, clients
        self.records: list[dict] = []
        self.lock = threading.Lock()

    def run(self, server: Server, seconds: float, tokens: int, refs_by_version: dict, action=None) -> None:
        stop = threading.Event()
        t0 = time.perf_counter()

        def client(i: int):
            with httpx.Client(base_url=server.url, timeout=120) as c:
                n = 0
                while not stop.is_set():
                    with self.lock:
                        if len(self.records) >= MAX_REQUESTS_PER_PHASE:
                            return
                    k = (i + n) % len(WAVS)
                    n += 1
                    start = time.perf_counter()
                    try:
                        r = server.transcribe(WAVS[k], client=c, max_completion_tokens=tokens)
                    except httpx.HTTPError as e:
                        self.add(start, "lost", type(e).__name__)
                        continue
                    if r.status_code == 200:
                        expected = refs_by_version.get(r.headers.get("x-voxtral-version"))
                        ok = expected is not None and r.json()["text"] == expected[k]
                        self.add(start, "ok" if ok else "mixed", r.headers.get("x-voxtral-version"))
                    else:
                        code = r.json()["error"]["code"]
                        self.add(start, "failed", f"{r.status_code} {code}")
                        if r.status_code == 503:
                            time.sleep(min(0.5, float(r.headers.get("retry-after", 1))))
        threads = [threading.Thread(target=client, args=(i,)) for i in range(self.clients)]
        for t in threads:
            t.start()
        self.extra = action() if action else {}
        remaining = seconds - (time.perf_counter() - t0)
        if remaining > 0:
            time.sleep(remaining)
        stop.set()
        for t in threads:
            t.join()
        self.wall = time.perf_counter() - t0

    def add(self, start: float, outcome: str, detail: str | None) -> None:
        with self.lock:
            self.records.append({"outcome": outcome, "detail": detail, "latency": time.perf_counter() - start})

    def row(self) -> list:
        by = Counter(r["outcome"] for r in self.records)
        ok = sorted(r["latency"] for r in self.records if r["outcome"] == "ok")
        pct = lambda q: ok[min(len(ok) - 1, int(q * len(ok)))] * 1000 if ok else float("nan")  # noqa: E731
        reasons = Counter(r["detail"] for r in self.records if r["outcome"] == "failed")
        n503 = sum(v for k, v in reasons.items() if k.startswith("503"))
        return [self.name, self.clients, len(self.records), by["ok"], by["failed"],
                ", ".join(f"{k} x{v}" for k, v in sorted(reasons.items())) or "-", by["lost"], by["mixed"],
                len(ok) / self.wall, pct(0.5), pct(0.95), pct(0.99), f"{n503 / max(1, len(self.records)):.0%}"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=None, help="steady-phase clients (default: capacity)")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--queue-depth", type=int, default=2)
    ap.add_argument("--queue-timeout", type=float, default=5.0)
    ap.add_argument("--json", help="also write the records here")
    a = ap.parse_args(argv)
    from nxdi_voxtral.release import deploy
    from nxdi_voxtral import Buckets
    buckets = Buckets(audio_chunks=(1,), kv_lengths=(512,))
    capacity = a.queue_depth + 1
    clients = a.clients or capacity
    with tempfile.TemporaryDirectory(prefix="serve_load_") as tmp:
        root = Path(tmp)
        t = time.perf_counter()
        weights, tars = build_releases(root, buckets)
        print(f"built two tp-2 releases in {time.perf_counter() - t:.0f} s", file=sys.stderr)
        texts = references(weights, buckets, a.tokens)
        fleet = root / "fleet"
        deploy(tars["v1"], fleet)
        server = Server(["--artifacts", str(fleet / "current"), "--queue-depth", str(a.queue_depth),
                         "--queue-timeout", str(a.queue_timeout), "--max-new-tokens", str(a.tokens),
                         "--watch", "1", "--grace", "30"], root / "server.log", env={"OMP_NUM_THREADS": "1"})
        phases, notes = [], {}
        try:
            v1 = server.wait_ready()["version"]
            refs = {v1: texts["v1"]}

            def swap():
                time.sleep(a.seconds / 4)
                out = subprocess.run([sys.executable, "-m", "artifacts", "deploy", str(tars["v2"]), "--to",
                                      str(fleet)], cwd=ROOT, capture_output=True, text=True, check=True)
                release = out.stdout.strip().split("-> ")[-1]
                v2 = release.rsplit("-", 1)[-1]  # releases/<time>-<manifest sha[:12]>: the server's version id
                refs[v2] = texts["v2"]
                deadline = time.time() + 300
                while server.health()["last_swap"].get("version") != v2 and time.time() < deadline:
                    time.sleep(0.1)
                return {"swap": server.health()["last_swap"]}

            def kill_rank():
                time.sleep(a.seconds / 4)
                while server.metric("voxtral_running") == 0:
                    time.sleep(0.005)
                pids = server.health()["rank_pids"]
                os.kill(pids[1], signal.SIGKILL)
                unready, t_kill = 0.0, time.perf_counter()
                while time.perf_counter() - t_kill < 300:
                    try:
                        ready = server.client.get("/health/ready", timeout=5).status_code == 200
                    except httpx.HTTPError:
                        ready = False
                    if ready and unready:
                        break
                    if not ready:
                        unready = time.perf_counter() - t_kill
                    time.sleep(0.05)
                return {"killed": pids[1], "unready_s": round(unready, 2), "old_pids_gone":
                        not any(pid_alive(p) for p in pids), "new_pids": server.health()["rank_pids"]}

            for name, n, action in (("steady", clients, None), ("overload 2x", 2 * capacity, None),
                                    ("hot swap", clients, swap), ("rank kill", clients, kill_rank)):
                phase = Phase(name, n)
                phase.run(server, a.seconds, a.tokens, refs, action)
                phases.append(phase)
                notes[name] = {**phase.extra, "ok by version": dict(Counter(
                    r["detail"] for r in phase.records if r["outcome"] == "ok"))}
                print(f"{name}: done", file=sys.stderr)
            rank_pids = server.health()["rank_pids"]
        finally:
            rc = server.stop(signal.SIGTERM)
        notes["sigterm"] = {"exit_code": rc, "rank_processes_left": [p for p in rank_pids if pid_alive(p)]}
        headers = ["phase", "clients", "sent", "succeeded", "failed", "failed by reason", "lost", "mixed",
                   "ok req/s", "p50 ms", "p95 ms", "p99 ms", "503 rate"]
        rows = [p.row() for p in phases]
        total = ["total", "-", *(sum(r[i] for r in rows) for i in (2, 3, 4)), "-", sum(r[6] for r in rows),
                 sum(r[7] for r in rows), *["-"] * 5]
        print(markdown_table(headers, rows + [total]))
        print()
        for k, v in notes.items():
            if v:
                print(f"- {k}: {json.dumps(v)}")
        if a.json:
            Path(a.json).write_text(json.dumps({"phases": {p.name: p.records for p in phases}, "notes": notes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
