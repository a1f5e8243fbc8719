"""Batching on CPU: throughput against batch size (greedy and speculative), the per-call cost of a batched decode
step and verify against a measured roofline, and long-audio transcription with one or eight KV slots.

Fixtures (--config):
  mid (default)  specdec.py's target in fp32: 12 layers, hidden 1024, FFN 2816, 16/4 heads x 64, vocab 32768; the
                 layers its 2-layer draft [0, 11] drops are damped x0.02 (controllable acceptance)
  real           realsize.py's Voxtral-Mini-3B-2507 size in bf16 (30 x 3072, vocab 131072; its cached ~10 GB
                 checkpoint, written on first use: realsize.bench_checkpoint). Greedy only in table 1; ~10 GB RAM
  --quick        the embedded demo model (synthetic.demo_dirs: 2 x 64, vocab 2048): a smoke test, not a measurement
The long-audio table uses the mid-size model of tp.py / realsize --config mid (common.mid_checkpoint: 8 x 1024,
undamped; the demo model with --quick).

Every table runs in its own child processes, one configuration per process (peak RSS is its own), one at a time;
inside a process the things compared alternate (common.time_calls: rounds of one call each, minima).

Table 1, throughput against batch size (--tables e2e): B prompts of different test audio (common.test_audio, seeds
0..7, 10 s to 30 s, one 30 s chunk each: audio bucket 1, KV bucket 512) through one
`m.generate([ids, ...], [feats, ...], max_new_tokens=N)` on a model loaded with max_batch_size=8 (batch buckets 1, 2,
4, 8), against the same B prompts one at a time (`m.generate(ids, feats, N)` each) on the same model, alternating.
One process per draft: greedy, layer draft K=4, n-gram K=4 (--config real: greedy).
  draft / K      the model's drafter;  B = prompts (sequences per decode step)
  tokens         new tokens of the B prompts (N each unless EOS)
  one at a time  decode tok/s = decode-phase tokens (all but each prompt's first) / the sum of the prompts' decode
                 seconds (generate's timings["decode_s"]); RTFx = audio seconds of the B prompts / the sum of their
                 generate() wall times (prefill included). Per prompt the minimum over rounds.
  batched        prefill s, decode s (timings of the one batched call), decode tok/s, RTFx (audio seconds / the
                 call's wall time); minima over rounds, each column its own
  x              batched / one at a time: decode tok/s and RTFx
  tau            tokens per verify call over the B prompts (speculative rows; the same batched and one at a time)
  same tokens    every prompt's batched output == its output alone (must be: batching never changes tokens)
  other CPU      other processes' share of the CPUs while the process measured (common.OtherCpuLoad)

Table 2, per-call cost (--tables calls): single graph calls at KV bucket 512, position 439 (a 391-token prompt + 48),
through the in-process engine of a model loaded with n-gram K=4 and max_batch_size=8 (the verify module takes any
number of rows per sequence through engine.run; nothing else is loaded). b sequences per call in KV slots 0..b-1,
each at the same position (specdec.call_fns(batch=b)). fp32 and bf16 (--config real: bf16), one process each.
  call           decode = token_generation (1 row per sequence); verify = K+1 = 5 rows per sequence, and one
                 sequence of 16 rows (a DFlash block's verify)
  b, rows        sequences per call, rows per call (b x rows per sequence)
  ms             min over the alternating rounds;  x decode = ms / the b=1 decode ms;  ms/seq = ms / b
  weight MB      parameters streamed per call: decoder layers + final norm + LM head (once per call, whatever b)
  KV MB          K/V bytes attention reads: b slots x the KV bucket
  GFLOP          2 x rows x matrix parameters (+ LM head) + 4 x rows x heads x head_dim x keys x layers
  roofline ms    max((weight + KV bytes) / BW, FLOPs / peak) (common.roofline_ms); BW = max streaming read of a
                 1 GiB fp32 tensor by t.sum(), torch.mv and our 1-row row_linear; peak = 2048^3 matmul of the
                 process's dtype (common.roofline_probe, measured in the same process)
  of roofline    roofline ms / ms;  roofline x decode = roofline ms / the b=1 decode's roofline ms

Table 3, long audio (--long, or --tables long): --long-minutes (60) minutes of synthetic speech-like audio (tone
bursts of 80-300 ms with harmonics at 100-250 Hz, 30-150 ms gaps, 2-8 s phrases, 0.4-2.5 s pauses; seeded)
written as a 16 kHz FLAC to a temporary directory, transcribed with `m.transcribe(path, language="en",
max_new_tokens=--long-tokens)` (32 per window: a random model's text is not the point, its cost is, and prefill of
5-minute windows dominates anyway) on the mid-size model with audio buckets 1, 2, 4, 10 chunks (--long-chunks; the
largest sets the window: 5 min less 1 s) and the one KV bucket that holds the largest prompt + the tokens, at
max_batch_size 1 and 8, each in its own child process.
  windows        segments of the transcription (windows.py cuts at quiet points)
  wall s / RTFx  transcribe()'s wall time / audio seconds per wall second (file decoding, windowing, prefill and
                 decode included); prefill s / decode s: its timings
  peak RSS MiB   VmHWM of the process at the end (weights, KV slots, a batch of windows' features)
  same tokens    every window's tokens == max_batch_size 1's

    python -m benchmarks.batch [--json PATH]            # tables 1 and 2 on the mid-size fixture (~12 min on idle
                                                        # cores; 48 min with another job on them)
    python -m benchmarks.batch --quick [--long]         # tiny smoke test (~2-5 min; --long: 3 minutes of audio)
    python -m benchmarks.batch --long --tables long     # the 1-hour long-audio table alone
    python -m benchmarks.batch --config real            # real size, bf16, greedy, 16 tokens (needs the machine
                                                        # alone; ~30 min on 2 cores, ~10 GB RAM per process)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (OtherCpuLoad, markdown_table, mid_checkpoint, peak_rss_mib, pct, roofline_ms,
                               roofline_probe, run_json_subprocess, test_audio, time_calls, timed, yes_no)

MODULE = "benchmarks.batch"
KV = 512
K = 4
BATCHES = (1, 2, 4, 8)
VERIFY_ALONE = 16   # one sequence of 16 rows (a DFlash block's verify)
SR = 16000
T0 = time.perf_counter()

# per --config: fixture, dtype of table 1, drafts of table 1, dtypes of table 2, new tokens, rounds
SETTINGS = {
    "quick": dict(dtype="fp32", kinds=[("plain", None), ("layers", K), ("ngram", K)], call_dtypes=["fp32", "bf16"],
                  tokens=8, rounds=1, call_rounds=2),
    "mid": dict(dtype="fp32", kinds=[("plain", None), ("layers", K), ("ngram", K)], call_dtypes=["fp32", "bf16"],
                tokens=64, rounds=3, call_rounds=10),
    "real": dict(dtype="bf16", kinds=[("plain", None)], call_dtypes=["bf16"], tokens=16, rounds=1, call_rounds=3),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def log(msg: str) -> None:
    print(f"[batch {time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def fixture(config: str) -> dict:
    """{"target": dir, "layers": dir} of a --config (written once into the benchmark cache)."""
    if config == "quick":
        from nxdi_voxtral.synthetic import demo_dirs
        return demo_dirs()
    if config == "real":
        from benchmarks.realsize import bench_checkpoint
        return bench_checkpoint("real")
    from benchmarks.specdec import checkpoints
    return checkpoints()


def load(config: str, kind: str, k: int | None, dtype: str, max_batch: int, buckets=None):
    from nxdi_voxtral import Buckets, NxDVoxtralSpecDec
    dirs = fixture(config)
    plain = kind == "plain"
    return NxDVoxtralSpecDec.from_pretrained(
        dirs["target"], draft=dirs["layers"] if kind == "layers" else None, draft_kind=None if plain else kind,
        num_speculative_tokens=k, dtype=DTYPES[dtype], max_batch_size=max_batch,
        buckets=buckets or Buckets(audio_chunks=(1,), kv_lengths=(KV,)))


def prompt_seconds(n: int) -> list[float]:
    """n audio lengths from 10 s to 30 s (one 30 s chunk each)."""
    return [round(10.0 + 20.0 * i / max(n - 1, 1), 2) for i in range(n)]


# ---------------------------------------------------------------- table 1: throughput against batch size

def bench_e2e(config: str, kind: str, k: int | None, n_new: int, rounds: int, batches=BATCHES) -> dict:
    """One draft configuration: batched generate() at each B alternating with the same prompts one at a time."""
    from nxdi_voxtral.speculative import SpecStats
    s = SETTINGS[config]
    n = max(batches)
    m, load_s = timed(load, config, kind, k, s["dtype"], n)
    secs = prompt_seconds(n)
    prompts = [m.prepare(test_audio(sec, seed=i), language="en", sampling_rate=SR) for i, sec in enumerate(secs)]
    ids, feats = [p.input_ids for p in prompts], [p.input_features for p in prompts]

    def one_at_a_time():
        out = []
        for i, f in zip(ids, feats):
            t = {}
            (toks, stats), wall = timed(m.generate, i, f, max_new_tokens=n_new, timings=t, return_stats=True)
            out.append(dict(tokens=toks[0].tolist(), stats=stats, prefill_s=t["prefill_s"], decode_s=t["decode_s"],
                            wall_s=wall))
        return dict(prompts=out, wall_s=sum(o["wall_s"] for o in out))

    def batched(b):
        def call():
            t = {}
            res, wall = timed(m.generate, ids[:b], feats[:b], max_new_tokens=n_new, timings=t, return_stats=True)
            return dict(tokens=[r[0][0].tolist() for r in res], stats=[r[1] for r in res],
                        prefill_s=t["prefill_s"], decode_s=t["decode_s"], wall_s=wall)
        return call

    log(f"{kind}: loaded in {load_s:.1f} s; warm-up")
    m.generate(ids[0], feats[0], max_new_tokens=2)
    m.generate(ids[:2], feats[:2], max_new_tokens=2)
    fns = {"one": one_at_a_time, **{f"b{b}": batched(b) for b in batches if b > 1}}
    outs = {}
    with OtherCpuLoad() as load_:
        time_calls(fns, rounds, warmup=0, seconds=lambda r: r["wall_s"], outputs=outs)
    one = outs["one"]
    alone = [one[-1]["prompts"][i]["tokens"] for i in range(n)]
    per_prompt = [{key: min(r["prompts"][i][key] for r in one) for key in ("prefill_s", "decode_s", "wall_s")}
                  for i in range(n)]
    rows = []
    for b in batches:
        toks = alone[:b]
        seq = dict(prefill_s=sum(p["prefill_s"] for p in per_prompt[:b]),
                   decode_s=sum(p["decode_s"] for p in per_prompt[:b]),
                   wall_s=sum(p["wall_s"] for p in per_prompt[:b]))
        if b == 1:
            # the same call: what must hold is that every round gave the same tokens
            bat, stats = dict(seq), [one[-1]["prompts"][0]["stats"]]
            same = all(r["prompts"][0]["tokens"] == toks[0] for r in one)
        else:
            runs = outs[f"b{b}"]
            bat = {key: min(r[key] for r in runs) for key in ("prefill_s", "decode_s", "wall_s")}
            same = all(r["tokens"] == toks for r in runs)
            stats = runs[-1]["stats"]
        merged = SpecStats.merged(stats)
        rows.append(dict(b=b, audio_s=sum(secs[:b]), tokens=sum(len(t) for t in toks),
                         decode_tokens=sum(len(t) - 1 for t in toks), one=seq, batched=bat, same=same,
                         tau=merged.tau if kind != "plain" else None, verify_calls=merged.verify_calls,
                         target_passes=merged.target_passes))
    return dict(table="e2e", config=config, kind=kind, k=m.setup.k if kind != "plain" else None, dtype=s["dtype"],
                n_new=n_new, rounds=rounds, seconds=secs, rows=rows, load_s=load_s, peak_rss_mib=peak_rss_mib(),
                other_cpu=load_.fraction, distinct=[len(set(t)) for t in alone])


def e2e_table(results: list[dict]) -> str:
    rows = []
    for res in results:
        for r in res["rows"]:
            one, bat = r["one"], r["batched"]
            tps_one, tps_bat = r["decode_tokens"] / one["decode_s"], r["decode_tokens"] / bat["decode_s"]
            rtf_one, rtf_bat = r["audio_s"] / one["wall_s"], r["audio_s"] / bat["wall_s"]
            rows.append([res["kind"], res["k"] or "-", r["b"], r["tokens"], tps_one, rtf_one, bat["prefill_s"],
                         bat["decode_s"], tps_bat, rtf_bat, tps_bat / tps_one, rtf_bat / rtf_one,
                         r["tau"] if r["tau"] is not None and r["verify_calls"] else "-", yes_no(r["same"]),
                         pct(res["other_cpu"]) if r["b"] == 1 else ""])
    return markdown_table(["draft", "K", "B", "tokens", "one at a time: decode tok/s", "RTFx", "batched: prefill s",
                           "decode s", "decode tok/s", "RTFx", "x tok/s", "x RTFx", "tau", "same tokens",
                           "other CPU"], rows)


# ---------------------------------------------------------------- table 2: per-call cost against b

def bench_calls(config: str, dtype: str, rounds: int, batches=BATCHES) -> dict:
    from benchmarks.specdec import call_fns, call_work
    host = roofline_probe(methods=("sum", "mv", "row_linear"), matmul_dtypes=(dtype,), rounds=min(rounds, 5))
    m = load(config, "ngram", K, dtype, max(batches))
    position = m.buckets.prompt_length(1, m.cfg) + 48
    fns, calls = {}, []
    for b in batches:
        f = call_fns(m, position, (K + 1,), batch=b)
        fns[f"decode b{b}"], fns[f"verify b{b}"] = f["decode"], f[f"verify {K + 1}"]
    fns["verify 16"] = call_fns(m, position, (VERIFY_ALONE,))[f"verify {VERIFY_ALONE}"]
    calls = [(f"decode b{b}", "decode", b, b) for b in batches] + \
        [(f"verify b{b}", "verify", b, b * (K + 1)) for b in batches] + [("verify 16", "verify", 1, VERIFY_ALONE)]
    log(f"calls {dtype}: {len(fns)} calls x {rounds} rounds")
    with OtherCpuLoad() as load_:
        ms = {name: 1e3 * s for name, s in time_calls(fns, rounds).items()}
    out = []
    for name, call, b, rows in calls:
        w = call_work(m, call, rows)  # KV of one sequence's slot: b of them are read
        out.append(dict(name=name, call=call, b=b, rows=rows, ms=ms[name], weight=w["weight"], kv=b * w["kv"],
                        flops=w["flops"]))
    return dict(table="calls", config=config, dtype=dtype, host=host, position=position, rounds=rounds, calls=out,
                peak_rss_mib=peak_rss_mib(), other_cpu=load_.fraction)


def calls_table(res: dict) -> str:
    host = res["host"]
    bw, peak = host["bandwidth_gbps"], host["peak_gflops"][res["dtype"]]
    base = res["calls"][0]
    base_roof = roofline_ms(base["weight"] + base["kv"], bw, base["flops"], peak)
    rows = []
    for c in res["calls"]:
        roof = roofline_ms(c["weight"] + c["kv"], bw, c["flops"], peak)
        rows.append([c["call"], c["b"], c["rows"], c["ms"], c["ms"] / base["ms"], c["ms"] / c["b"], c["weight"] / 1e6,
                     c["kv"] / 1e6, c["flops"] / 1e9, roof, roof / c["ms"], roof / base_roof])
    return markdown_table(["call", "b", "rows", "ms", "x decode", "ms/seq", "weight MB", "KV MB", "GFLOP",
                           "roofline ms", "of roofline", "roofline x decode"], rows)


# ---------------------------------------------------------------- table 3: long audio

def speech_like_blocks(seconds: float, sr: int = SR, seed: int = 0, block_s: float = 60.0):
    """Synthetic speech-like audio in blocks of ~block_s: phrases of 2-8 s made of tone bursts (80-300 ms, f0
    100-250 Hz with 4 decaying harmonics, a Hann envelope, a little noise) with 30-150 ms gaps, and 0.4-2.5 s pauses
    of near-silence between phrases. Deterministic for a seed."""
    rng = np.random.default_rng(seed)
    total, done, buf = int(seconds * sr), 0, []

    def burst():
        n = int(rng.uniform(0.08, 0.30) * sr)
        t = np.arange(n) / sr
        f0 = rng.uniform(100, 250)
        wave = sum((0.6 ** h) * np.sin(2 * np.pi * f0 * (h + 1) * t + rng.uniform(0, 2 * np.pi)) for h in range(4))
        return (0.25 * np.hanning(n) * wave + 0.01 * rng.standard_normal(n)).astype(np.float32)

    def quiet(lo, hi):
        return (0.001 * rng.standard_normal(int(rng.uniform(lo, hi) * sr))).astype(np.float32)

    while done < total:
        phrase_end = rng.uniform(2.0, 8.0) * sr
        n = 0
        while n < phrase_end:
            for part in (burst(), quiet(0.03, 0.15)):
                buf.append(part)
                n += len(part)
        buf.append(quiet(0.4, 2.5))
        if sum(len(b) for b in buf) >= block_s * sr or done + sum(len(b) for b in buf) >= total:
            block = np.concatenate(buf)[:total - done]
            buf = []
            done += len(block)
            yield block


def write_long_audio(path: Path, minutes: float, seed: int = 0) -> float:
    """speech_like_blocks as a 16 kHz mono FLAC (PCM 16) -> seconds written."""
    import soundfile as sf
    n = 0
    with sf.SoundFile(path, "w", samplerate=SR, channels=1, format="FLAC", subtype="PCM_16") as f:
        for block in speech_like_blocks(60.0 * minutes, seed=seed):
            f.write(block)
            n += len(block)
    return n / SR


def long_buckets(chunks: int, tokens: int, cfg):
    """Audio buckets 1, 2, 4, ... up to `chunks` (it included), one KV bucket: the smallest power of two >= 512
    holding the largest prompt + tokens + 1."""
    from nxdi_voxtral import Buckets
    audio = tuple(sorted({c for c in (1, 2, 4, 10) if c < chunks} | {chunks}))
    need = Buckets(audio_chunks=audio, kv_lengths=(1 << 30,)).prompt_length(chunks, cfg) + tokens + 1
    return Buckets(audio_chunks=audio, kv_lengths=(max(512, 1 << (need - 1).bit_length()),))


def bench_long(config: str, audio: str, max_batch: int, chunks: int, tokens: int) -> dict:
    from nxdi_voxtral import NxDVoxtralSpecDec
    from nxdi_voxtral.config import VoxtralConfig
    target = fixture("quick")["target"] if config == "quick" else mid_checkpoint()
    buckets = long_buckets(chunks, tokens, VoxtralConfig.from_dir(target))
    m, load_s = timed(NxDVoxtralSpecDec.from_pretrained, target, buckets=buckets, max_batch_size=max_batch)
    log(f"long b{max_batch}: loaded in {load_s:.1f} s (audio buckets {buckets.audio_chunks}, KV {buckets.kv_lengths}, "
        f"batch {m.buckets.batch_sizes}); transcribing {audio}")
    with OtherCpuLoad() as load_:
        tr, wall = timed(m.transcribe, audio, language="en", max_new_tokens=tokens)
    return dict(table="long", config=config, max_batch=max_batch, chunks=chunks, tokens=tokens,
                buckets=[list(buckets.audio_chunks), list(buckets.kv_lengths)], load_s=load_s, wall_s=wall,
                audio_s=tr.timings["audio_s"], prefill_s=tr.timings["prefill_s"], decode_s=tr.timings["decode_s"],
                windows=len(tr.segments), window_s=[round(s.end - s.start, 2) for s in tr.segments],
                window_tokens=[s.token_ids for s in tr.segments], peak_rss_mib=peak_rss_mib(),
                other_cpu=load_.fraction)


def long_table(results: list[dict]) -> str:
    ref = results[0]["window_tokens"]
    rows = [[r["max_batch"], r["audio_s"] / 60, r["windows"], r["wall_s"], r["audio_s"] / r["wall_s"], r["prefill_s"],
             r["decode_s"], sum(len(t) for t in r["window_tokens"]), r["peak_rss_mib"],
             yes_no(r["window_tokens"] == ref), pct(r["other_cpu"])] for r in results]
    return markdown_table(["max_batch_size", "audio min", "windows", "wall s", "RTFx", "prefill s", "decode s",
                           "tokens", "peak RSS MiB", "same tokens", "other CPU"], rows)


# ---------------------------------------------------------------- parent

def code_state() -> str:
    from benchmarks.realsize import code_state as realsize_code_state
    return realsize_code_state()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=["mid", "real"], default="mid")
    ap.add_argument("--quick", action="store_true", help="the tiny demo model, few tokens, one round (smoke test)")
    ap.add_argument("--tables", default=None, help="comma list of e2e, calls, long (default e2e,calls; + long "
                                                   "with --long)")
    ap.add_argument("--long", action="store_true", help="also the long-audio table")
    ap.add_argument("--long-minutes", type=float, default=None, help="minutes of long audio (60; --quick 3)")
    ap.add_argument("--long-chunks", type=int, default=None, help="largest audio bucket of the long table, in 30 s "
                                                                  "chunks (10: 5 min windows; --quick 2)")
    ap.add_argument("--long-tokens", type=int, default=None, help="max_new_tokens per window (32; --quick 8)")
    ap.add_argument("--tokens", type=int, default=None, help="new tokens per prompt in table 1 (mid 64, real 16)")
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds of table 1")
    ap.add_argument("--json", default=None, help="write every result to this path")
    ap.add_argument("--impl", choices=["e2e", "calls", "long"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--kind", default="plain", help=argparse.SUPPRESS)
    ap.add_argument("-k", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="fp32", help=argparse.SUPPRESS)
    ap.add_argument("--max-batch", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--audio", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    config = "quick" if args.quick else args.config
    s = SETTINGS[config]
    tokens = args.tokens or s["tokens"]
    rounds = args.rounds or s["rounds"]
    long_minutes = args.long_minutes or (3.0 if args.quick else 60.0)
    long_chunks = args.long_chunks or (2 if args.quick else 10)
    long_tokens = args.long_tokens or (8 if args.quick else 32)
    if args.impl:
        res = (bench_e2e(config, args.kind, args.k, tokens, rounds) if args.impl == "e2e" else
               bench_calls(config, args.dtype, s["call_rounds"]) if args.impl == "calls" else
               bench_long(config, args.audio, args.max_batch, long_chunks, long_tokens))
        print(json.dumps(res))
        return
    tables = args.tables.split(",") if args.tables else ["e2e", "calls"] + (["long"] if args.long else [])
    child = (["--quick"] if args.quick else ["--config", args.config]) + ["--tokens", str(tokens), "--rounds",
                                                                          str(rounds)]
    load1, load5, _ = os.getloadavg()
    header = (f"benchmarks.batch, {config}: code {code_state()}; {time.strftime('%Y-%m-%d %H:%M')}; {os.cpu_count()} "
              f"CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads); load average before: "
              f"{load1:.2f} (1 min), {load5:.2f} (5 min)")
    log(header)
    fixture(config)  # written once, before any child
    results = {"header": header, "config": config}
    failed = False
    if "e2e" in tables:
        results["e2e"] = []
        for kind, k in s["kinds"]:
            log(f"table 1: {kind}" + (f" K={k}" if k else ""))
            results["e2e"].append(run_json_subprocess(MODULE, ["--impl", "e2e", "--kind", kind, *child]
                                                      + (["-k", str(k)] if k else [])))
    if "calls" in tables:
        results["calls"] = []
        for dtype in s["call_dtypes"]:
            log(f"table 2: {dtype}")
            results["calls"].append(run_json_subprocess(MODULE, ["--impl", "calls", "--dtype", dtype, *child]))
    if "long" in tables:
        results["long"] = []
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "long.flac"
            log(f"table 3: writing {long_minutes:g} min of speech-like audio to {path}")
            audio_s, write_s = timed(write_long_audio, path, long_minutes)
            log(f"wrote {audio_s:.0f} s of audio ({path.stat().st_size / 2**20:.1f} MiB FLAC) in {write_s:.1f} s")
            for b in (1, 8):
                log(f"table 3: max_batch_size {b}")
                results["long"].append(run_json_subprocess(
                    MODULE, ["--impl", "long", "--audio", str(path), "--max-batch", str(b), "--long-chunks",
                             str(long_chunks), "--long-tokens", str(long_tokens), *child]))
    out = [header]
    if "e2e" in results:
        e = results["e2e"][0]
        out.append(f"\n### Throughput against batch size ({config}, {e['dtype']}; {tokens} new tokens per prompt, "
                   f"prompts of {e['seconds'][0]:g}-{e['seconds'][-1]:g} s audio; minima of {rounds} alternating "
                   f"rounds)\n\n" + e2e_table(results["e2e"]))
        failed |= not all(r["same"] for res in results["e2e"] for r in res["rows"])
        out.append("\npeak RSS MiB: " + ", ".join(f"{r['kind']} {r['peak_rss_mib']:.0f}" for r in results["e2e"]))
    for c in results.get("calls", []):
        h = c["host"]
        out.append(f"\n### Per-call cost ({config}, {c['dtype']}; KV bucket {KV}, position {c['position']}; minima "
                   f"of {c['rounds']} alternating rounds; other CPU {pct(c['other_cpu'])})\n\nhost: bandwidth "
                   f"{h['bandwidth_gbps']:.1f} GB/s ({h['bandwidth_method']}), {c['dtype']} matmul peak "
                   f"{h['peak_gflops'][c['dtype']]:.0f} GFLOP/s\n\n" + calls_table(c))
    if "long" in results:
        r0 = results["long"][0]
        out.append(f"\n### Long audio ({r0['audio_s'] / 60:.1f} min synthetic speech-like FLAC; audio buckets "
                   f"{r0['buckets'][0]}, KV {r0['buckets'][1]}; max_new_tokens {r0['tokens']} per window)\n\n"
                   + long_table(results["long"]))
        failed |= not all(r["window_tokens"] == r0["window_tokens"] for r in results["long"])
    text = "\n".join(out)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({**results, "text": text}, indent=1))
        log(f"wrote {args.json}")
    if failed:
        raise SystemExit("batched output differs from batch 1 (see 'same tokens')")


if __name__ == "__main__":
    main()
