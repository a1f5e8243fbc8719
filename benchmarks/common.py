"""Helpers shared by the benchmarks: the mid-size random checkpoint, test audio, timing, peak RSS, tables.

Nothing here is part of the package; benchmarks are run as scripts from the repository root, e.g.
    python -m benchmarks.greedy_vs_transformers
"""
from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------- the mid-size random model

MID_SEED = 0
# decoder weight std: 0.3 is what tiny models use; checked here to give varied (non-repeating) greedy output
MID_STD = 0.3


def mid_config():
    from nxdi_voxtral.config import AudioEncoderConfig, TextConfig, VoxtralConfig
    audio = AudioEncoderConfig(hidden_size=256, intermediate_size=1024, num_layers=2, num_heads=4)
    text = TextConfig(vocab_size=32768, hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16,
                      num_kv_heads=4, head_dim=64)
    return VoxtralConfig(audio=audio, text=text)


def cache_root() -> Path:
    return Path(os.environ.get("NXDI_VOXTRAL_BENCH_CACHE",
                               Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nxdi_voxtral_bench"))


def cached_checkpoint(cfg, seed: int, std: float, name: str = "ckpt") -> Path:
    """Write a random checkpoint once into the cache (keyed by config, seed, std); atomic rename, safe to race."""
    import inspect
    from nxdi_voxtral import synthetic
    from nxdi_voxtral.synthetic import write_random_checkpoint
    # the writer's code is part of the key: a change to how weights are drawn or written rebuilds the cache
    code = "".join(inspect.getsource(getattr(synthetic, f)) for f in
                   ("random_state_dict", "write_checkpoint", "write_tokenizer", "hf_config_dict"))
    key = json.dumps({"cfg": asdict(cfg), "seed": seed, "std": std, "code": code}, sort_keys=True)
    final = cache_root() / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (final / "config.json").is_file() and any(final.glob("model*.safetensors")):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".building-"))
    write_random_checkpoint(tmp, cfg, seed=seed, std=std)
    try:
        tmp.rename(final)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def mid_checkpoint(seed: int = MID_SEED, std: float = MID_STD) -> Path:
    return cached_checkpoint(mid_config(), seed, std, name="mid")


def test_audio(seconds: float = 30.0, sr: int = 16000, seed: int = 0) -> np.ndarray:
    """A linear chirp (200 Hz -> 4 kHz) plus a little seeded noise: deterministic, non-silent, speech-band."""
    t = np.arange(int(seconds * sr), dtype=np.float64) / sr
    f0, f1 = 200.0, 4000.0
    phase = 2 * np.pi * (f0 * t + (f1 - f0) * t ** 2 / (2 * seconds))
    noise = np.random.default_rng(seed).standard_normal(t.shape) * 0.02
    return (0.3 * np.sin(phase) + noise).astype(np.float32)


# ---------------------------------------------------------------- measurement

def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, in MiB.

    Linux: VmHWM of /proc/self/status, the high-water mark of this address space (reset by exec). Not
    ru_maxrss: Linux carries ru_maxrss over fork + exec, so a child started by a parent that once held more
    memory would report the parent's peak. Elsewhere: ru_maxrss (KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / (1024 * 1024) if sys.platform == "darwin" else r / 1024


def cpu_busy_fraction(seconds: float = 1.0) -> float | None:
    """Fraction of all CPUs busy over a short sample (Linux /proc/stat); None where unavailable.

    Take it before a benchmark: other processes competing for the cores inflate every timing."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
        return sum(v), idle
    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except (OSError, ValueError):
        return None
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


class OtherCpuLoad:
    """Context manager: how busy the CPUs were with *other* processes while the block ran (Linux).

    System-wide busy CPU time (/proc/stat) minus this process's and its waited-for children's CPU time, as a
    fraction of all CPUs x wall time. `.fraction` is None where /proc/stat is unavailable."""

    @staticmethod
    def _stat():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + (v[4] if len(v) > 4 else 0)

    @staticmethod
    def _own_cpu_s():
        r = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        return sum(x.ru_utime + x.ru_stime for x in r)

    def __enter__(self):
        self.fraction = None
        try:
            self._t0, self._i0 = self._stat()
        except (OSError, ValueError):
            self._t0 = None
        self._own0 = self._own_cpu_s()
        return self

    def __exit__(self, *exc):
        if self._t0 is None:
            return False
        t1, i1 = self._stat()
        hz = os.sysconf("SC_CLK_TCK")
        total, busy = (t1 - self._t0) / hz, ((t1 - self._t0) - (i1 - self._i0)) / hz
        self.fraction = max(0.0, busy - (self._own_cpu_s() - self._own0)) / max(total, 1e-9)
        return False


def timed(fn, *args, **kwargs):
    """-> (result, seconds)."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def median(xs) -> float:
    return float(statistics.median(xs))


def distinct_ratio(tokens) -> tuple[int, int]:
    """(distinct tokens, total tokens): a cheap check that greedy output is not degenerate."""
    tokens = list(tokens)
    return len(set(tokens)), len(tokens)


def run_json_subprocess(module: str, args: list[str], timeout: float | None = None) -> dict:
    """Run `python -m module args...` (from the repo root) in a fresh process; its last stdout line is JSON.

    A fresh process per implementation keeps peak-RSS numbers from mixing. stderr passes through."""
    cmd = [sys.executable, "-m", module, *args]
    p = subprocess.run(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {p.returncode}\n{p.stdout[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- output

def markdown_table(headers: list[str], rows: list[list]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
        return str(v)
    cells = [[fmt(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in cells)])


# ---------------------------------------------------------------- the real-size configuration

# Voxtral-Mini-3B-2507 (DESIGN.md §1; the package's config defaults): decoder 30 x 3072, FFN 8192, 32/8 heads x 128,
# vocab 131072, untied LM head; audio encoder 32 x 1280, FFN 5120, 20 heads. Same as cuda_realsize.configs(False).
REALSIZE_DRAFT_LAYERS = [0, 10, 20, 29]   # the 4-layer pruned layer draft


def realsize_config():
    from nxdi_voxtral.config import VoxtralConfig
    return VoxtralConfig()


def proc_mem_gib(pid="self") -> dict:
    """VmHWM (peak), VmRSS, RssAnon, RssFile of a process (Linux /proc/PID/status), in GiB; {} elsewhere."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":")[0]
                if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                    out[key] = int(line.split()[1]) / 2**20
    except OSError:
        pass
    return out
