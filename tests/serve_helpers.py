"""A `python -m nxdi_voxtral serve` subprocess on a free loopback port, and small clients for it (tests and
benchmarks/serve_load.py)."""
from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wav_bytes(samples: np.ndarray, sr: int = 16000, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, sr, format=fmt, subtype=subtype)
    return buf.getvalue()


def noise(seconds: float, seed: int = 0, sr: int = 16000) -> np.ndarray:
    return (np.random.RandomState(seed).randn(int(seconds * sr)) * 0.1).astype(np.float32)


def speech_like(seconds: float, seed: int = 0, sr: int = 16000) -> np.ndarray:
    """Bursts of noisy tones ("words", 0.2-0.8 s) separated by silent gaps (0.15-0.6 s): long audio has quiet points
    to cut its windows at."""
    rng = np.random.default_rng(seed)
    out, n = [], int(seconds * sr)
    while sum(len(x) for x in out) < n:
        t = np.arange(int(rng.uniform(0.2, 0.8) * sr)) / sr
        word = 0.3 * np.sin(2 * np.pi * rng.uniform(150, 900) * t) + 0.05 * rng.standard_normal(len(t))
        out += [word.astype(np.float32), np.zeros(int(rng.uniform(0.15, 0.6) * sr), np.float32)]
    return np.concatenate(out)[:n]


class Server:
    def __init__(self, args: list[str], log_path: Path, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "nxdi_voxtral", "serve", "--port", str(self.port), *args],
                                     cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.client = httpx.Client(base_url=self.url, timeout=120)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 300) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                r = self.client.get("/health/ready", timeout=5)
                if r.status_code == 200:
                    return self.health()
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()[-4000:]}")

    def health(self) -> dict:
        return self.client.get("/health", timeout=10).json()

    def metrics(self) -> dict:
        """{(name, frozenset(labels)): value} of every sample."""
        text = self.client.get("/metrics", timeout=10).text
        return {(s.name, frozenset(s.labels.items())): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def metric(self, name: str, **labels) -> float:
        return self.metrics().get((name, frozenset(labels.items())), 0.0)

    def transcribe(self, audio: bytes, client: httpx.Client | None = None, filename="clip.wav",
                   content_type="audio/wav", **fields) -> httpx.Response:
        return (client or self.client).post("/v1/audio/transcriptions", files={"file": (filename, audio, content_type)},
                                            data={k: str(v) for k, v in fields.items()})

    def stop(self, sig=None, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig) if sig else self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.client.close()
        self._log.close()
        return self.proc.returncode


def sse_events(lines) -> list:
    """`data: ...` lines of a server-sent-event stream -> parsed JSON objects, and the string "[DONE]"."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False
