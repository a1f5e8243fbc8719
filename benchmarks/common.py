"""Helpers shared by the benchmarks: the mid-size random checkpoint, test audio and prompts, and the one
implementation of each measurement every benchmark uses:

    timing          time_calls (repeated / alternating calls, min or median, wall clock or CUDA events), timed
    roofline        roofline_probe (streaming-read bandwidth + matmul peak, measured now), roofline_ms
    weight bytes    weight_bytes (Engine.weight_bytes() on any modules); a loaded model: m.ranks.call("weight_bytes")
    tables          markdown_table (+ pct, yes_no cells)

Nothing here is part of the package; benchmarks are run as scripts from the repository root, e.g.
    python -m benchmarks.greedy_vs_transformers
cuda_realsize.py, run as a file on a GPU host, imports this module too: keep its top-level imports to the standard
library and numpy (anything from the package or torch is imported inside the function that needs it).
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


def make_inputs(model_dir: Path, seconds: float):
    """Prompt ids [1, T] and features [n_chunks, 128, 3000] of test_audio(seconds) from the package's own front end
    (tokenizer only)."""
    from nxdi_voxtral.config import VoxtralConfig
    from nxdi_voxtral.processing import build_prompt, load_tokenizer
    cfg = VoxtralConfig.from_dir(model_dir)
    p = build_prompt(load_tokenizer(model_dir), test_audio(seconds), "en", cfg.audio.num_mel_bins,
                     cfg.audio.mel_frames_per_chunk)
    return p.input_ids, p.input_features


def save_inputs(path: Path, input_ids, input_features) -> None:
    """make_inputs' prompt to a file, for child processes (load_inputs)."""
    import torch
    torch.save({"input_ids": input_ids, "input_features": input_features}, path)


def load_inputs(path):
    """-> (input_ids, input_features) saved by save_inputs."""
    import torch
    d = torch.load(path)
    return d["input_ids"], d["input_features"]


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


def median(xs) -> float:
    return float(statistics.median(xs))


# ---------------------------------------------------------------- timing

def timed(fn, *args, **kwargs):
    """One wall-clock measurement (time.perf_counter) of fn(*args, **kwargs) -> (result, seconds). For one-off
    phases (loading, a whole run); anything measured more than once goes through time_calls."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def time_calls(fns, rounds: int = 5, *, warmup: int = 1, reduce=min, device: str = "cpu", seconds=None,
               outputs=None):
    """Seconds per call of each zero-argument callable in `fns` ({name: fn} -> {name: s}; a lone fn -> s).

    `warmup` untimed calls of each fn, then `rounds` rounds calling every fn once in turn -- alternating, so drift
    in the machine's speed (the VM's bandwidth phases, other processes) hits every fn alike -- each call timed
    alone, and the times of each fn reduced with `reduce`: min (default: the least disturbed call) or median.
    A call's time: wall clock (time.perf_counter) around it on the CPU; on a CUDA `device`, CUDA events recorded
    before and after it on the current stream (the GPU time of the work it queued, launch gaps included).
    seconds: a function of a call's return value giving the number to use instead (calls that time their own
    phase, e.g. generate's timings["decode_s"]; then any unit). outputs: receives every timed call's return
    value, in order ({name: [...]} for a dict of fns, a list for a lone fn)."""
    single = callable(fns)
    fns = {None: fns} if single else dict(fns)
    events = seconds is None and str(device).startswith("cuda")
    if events:
        import torch

    def one(fn):
        if not events:
            out, s = timed(fn)
            return out, (s if seconds is None else seconds(out))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return out, start.elapsed_time(end) / 1e3

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            out, s = one(fn)
            times[name].append(s)
            if outputs is not None:
                (outputs if single else outputs.setdefault(name, [])).append(out)
    best = {name: reduce(t) for name, t in times.items()}
    return best[None] if single else best


# ---------------------------------------------------------------- roofline

def roofline_probe(device: str = "cpu", *, read_gib: float = 1.0, methods=("sum",), matmul_n: int | None = 2048,
                   matmul_dtypes=("fp32",), rounds: int = 5) -> dict:
    """The machine's roofline ceilings, measured now: memory bandwidth and matmul peak. Both drift (this VM's
    bandwidth swings between two levels from minute to minute), so measure in the run whose timings they bound.

    Bandwidth: a `read_gib` GiB fp32 tensor t [rows, 8192] on `device`, streamed by each of `methods` in turn
    (time_calls: one warm-up, `rounds` alternating rounds, min):
      "sum"         t.sum()                                   GB/s of bytes read
      "mv"          torch.mv(t, x)                            GB/s of bytes read
      "row_linear"  our 1-row row_linear(x[None], t): the CPU kernel, or its torch twin without the library
      "copy"        dst.copy_(t)                              GB/s of bytes read + written (2 x t)
    and the fastest counts. Peak: an n x n @ n x n matmul (n = matmul_n; None: skipped) in each of
    matmul_dtypes ("fp32", "bf16"), alternating, 2 n^3 / min time.
    -> JSON-able dict(device, threads, read_gbps={method label: GB/s}, bandwidth_method, bandwidth_gbps,
    peak_gflops={dtype: GFLOP/s})."""
    import torch

    def read_gbps() -> dict:  # a function of its own: the tensors are freed before the matmul
        cols = 8192
        t = torch.ones(max(1, int(read_gib * 2**30) // (4 * cols)), cols, device=device)
        x = torch.ones(cols, device=device)
        fns, nbytes = {}, {}
        for method in methods:
            if method == "sum":
                fns["t.sum()"], nbytes["t.sum()"] = t.sum, t.nbytes
            elif method == "mv":
                fns["torch.mv"], nbytes["torch.mv"] = (lambda: torch.mv(t, x)), t.nbytes
            elif method == "row_linear":
                from nxdi_voxtral.cpu_kernels import kernel_library, row_linear
                label = f"row_linear 1 row ({'kernel' if kernel_library() is not None else 'torch twin'})"
                fns[label], nbytes[label] = (lambda: row_linear(x[None], t)), t.nbytes
            elif method == "copy":
                dst = torch.empty_like(t)
                fns["copy (read + write)"], nbytes["copy (read + write)"] = (lambda: dst.copy_(t)), 2 * t.nbytes
            else:
                raise ValueError(f"unknown bandwidth method {method!r}")
        return {name: nbytes[name] / s / 1e9 for name, s in time_calls(fns, rounds, device=device).items()}

    gbps = read_gbps()
    peak = {}
    if matmul_n:
        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
        a = torch.randn(matmul_n, matmul_n, device=device)
        mats = {d: a.to(dtypes[d]) for d in matmul_dtypes}
        s = time_calls({d: (lambda m=m: m @ m) for d, m in mats.items()}, rounds, device=device)
        peak = {d: 2 * matmul_n**3 / v / 1e9 for d, v in s.items()}
    kept = max(gbps, key=gbps.get)
    return dict(device=str(device), threads=torch.get_num_threads(), read_gbps=gbps, bandwidth_method=kept,
                bandwidth_gbps=gbps[kept], peak_gflops=peak)


def roofline_ms(nbytes: float, gbps: float, flops: float = 0.0, gflops: float | None = None) -> float:
    """The roofline time of one call in ms: max(bytes / bandwidth, FLOPs / matmul peak) (bandwidth in GB/s and
    peak in GFLOP/s, e.g. roofline_probe's; no peak: bytes alone)."""
    return 1e3 * max(nbytes / (gbps * 1e9), flops / (gflops * 1e9) if gflops else 0.0)


# ---------------------------------------------------------------- weight bytes

def weight_bytes(*modules) -> int:
    """Bytes of the parameters of these torch modules (parts of our model, a draft, transformers' model), a
    tensor held by several counted once: Engine.weight_bytes() itself, run on an Engine that holds just them.
    A loaded NxDVoxtralSpecDec: use its engines' own, m.ranks.call("weight_bytes") (one number per rank)."""
    from torch import nn
    from nxdi_voxtral.engine import Engine
    return Engine(setup=None, model=nn.ModuleList(modules)).weight_bytes()


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

def markdown_table(headers: list[str], rows: list[list], *, pad: bool = True, big: float = 10.0,
                   big_decimals: int = 1) -> str:
    """Every benchmark's table: a GitHub markdown table of `rows` under `headers`. Floats get 3 significant digits
    below `big` and `big_decimals` decimals from there on; anything else str(). pad: columns aligned
    (`| a   | b |` over `|-----|---|`); pad=False: bare cells over `|---|---|`."""
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < big else f"{v:.{big_decimals}f}"
        return str(v)
    cells = [[fmt(v) for v in r] for r in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) if pad else 0 for i, h in enumerate(headers)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) if pad else "---" for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in cells)])


def pct(fraction) -> str:
    """A share as a table cell: 0.123 -> '12%'; None (not measured) -> 'n/a'."""
    return "n/a" if fraction is None else f"{100 * fraction:.0f}%"


def yes_no(ok: bool) -> str:
    return "yes" if ok else "no"


# ---------------------------------------------------------------- the real-size configuration

# Voxtral-Mini-3B-2507 (docs/design.md §1; the config defaults): decoder 30 x 3072, FFN 8192, 32/8 heads x 128,
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
