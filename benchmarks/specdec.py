"""Speculative decoding on CPU: per-call costs against a measured roofline, and end to end (layer draft K = 2, 4, 8,
n-gram, DFlash) against our own plain greedy and transformers' greedy.

Fixture: a random target with Voxtral's proportions (12 layers, hidden 1024, FFN 2816, 16/4 heads x 64, vocab
32768) whose layers 1..10 are damped (o_proj/down_proj x DAMP), so the 2-layer layer draft keeping target layers
[0, 11] agrees with it most of the time (controllable acceptance); a random 5-layer DFlash draft (block 16) reading
target layers (1, 3, 5, 8, 10). 30 s of audio, KV bucket 512, batch 1, torch's default threads.

Every timing is the minimum over >= 5 runs, ALTERNATING between the things compared, in one process per
configuration (a subprocess each, so peak RSS is its own).

Host line (common.roofline_probe): streaming-read bandwidth BW = max over `t.sum()`, `torch.mv` and 1-row
`row_linear` over a 1 GiB fp32 tensor (the method kept is named), compute peak = 2048^3 matmul GFLOP/s (fp32; bf16
for the bf16 table). Timings: common.time_calls; weight bytes: common.weight_bytes (Engine.weight_bytes()).

Per-call table (one process per dtype; fp32, and bf16 too with --dtype bf16): single graph calls at the KV bucket.
  rows         decode = 1-row token_generation; verify with K+1 rows (the eager verify graph is the same module for
               every K, called through engine.run, which skips the per-K shape check); draft_fused_k = K=4 steps of
               the 2-layer draft; dflash_draft = the 5-layer block pass on 16 rows
  ms           min over the alternating rounds;  x decode = ms / decode ms
  weight MB    parameters streamed per call: target decoder layers + final norm + LM head (decode, verify); draft
               layers + norm + LM head, K times (draft_fused_k); all DFlash weights (fc, layers, norms) + the
               target's LM head (dflash_draft). The embedding rows read are negligible and not counted.
  KV MB        K/V cache bytes attention reads at the bucket (once per layer per pass)
  GFLOP        2 x rows x matrix parameters (+ LM head rows, + DFlash context k/v projections) + 4 x rows x heads x
               head_dim x keys x layers (attention)
  roofline ms  max((weight + KV bytes) / BW, FLOPs / peak);  of roofline = roofline ms / ms;
               roofline x decode = roofline ms / decode's roofline ms (the best ratio this host allows)
  target       the issue's targets: verify K+1 <= 8 rows <= 1.3x decode, 16 rows <= 1.6x; dflash_draft <= 0.6x

End-to-end table (fp32): 96 new tokens (32 with --quick), each configuration in its own process alternating its
speculative generate() with plain greedy on the same target weights (prefill, then token_generation per token).
  tau          mean(accepted + 1) per verify call;  passes/tok = target passes after prefill / tokens
  ms/tok       decode-phase wall time per token after prefill (min over runs)
  speed-up     in-process plain greedy ms/tok / this row's ms/tok (for transformers rows: our greedy ms/tok
               measured alternately in the same process / transformers' ms/tok, i.e. "ours / transformers")
  analytical   (tokens - 1) x t(decode) / (verify calls x (t(verify) + t(draft)) + n-gram misses x t(decode)), from
               per-call costs measured in that process
  loop eff.    speed-up / analytical (1.0 = no host overhead)
  target       layer draft K=4 speed-up >= 1.6x; ours / transformers greedy <= 0.55
  other CPU    other processes' share of all CPUs while this process measured (common.OtherCpuLoad). Mind it: with
               another 2-thread job on the 2 cores, every graph call at 2 threads was ~20x slower (765 vs 34 ms
               decode at 1 thread), not 2x; minima do not filter that out.
Every configuration's tokens must equal plain greedy's (asserted); transformers rows say whether theirs do.
transformers: greedy = (t(generate N) - t(generate 1)) / (N - 1) with minima; assisted = generate(assistant_model=
<same layer draft>, num_assistant_tokens=4, constant schedule). Their process also holds our plain model: no RSS.

    python -m benchmarks.specdec [--dtype bf16] [--json PATH]   (~12 min on 2 cores, + ~1 min for bf16)
    python -m benchmarks.specdec --quick      (32 tokens, 5 rounds, plain / layers K=4 / dflash + transformers; ~5 min)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (OtherCpuLoad, cache_root, markdown_table, peak_rss_mib, pct, roofline_ms, roofline_probe,
                               run_json_subprocess, test_audio, time_calls, timed, weight_bytes, yes_no)

MODULE = "benchmarks.specdec"
DAMP, KEEP, SEED, STD = 0.02, [0, 11], 0, 0.3
DFLASH_LAYERS, DFLASH_TARGET_IDS = 5, (1, 3, 5, 8, 10)
KV = 512
VERIFY_ROWS = (2, 3, 5, 8, 16)
CONFIGS = [("plain", None)] + [("layers", k) for k in (2, 4, 8)] + [("ngram", 4), ("dflash", 15)]
QUICK_CONFIGS = [("plain", None), ("layers", 4), ("dflash", 15)]
FULL, QUICK = dict(n_new=96, runs=5, rounds=10), dict(n_new=32, runs=5, rounds=5)


def spec_config():
    from nxdi_voxtral.config import AudioEncoderConfig, TextConfig, VoxtralConfig
    return VoxtralConfig(audio=AudioEncoderConfig(hidden_size=256, intermediate_size=1024, num_layers=2, num_heads=4),
                         text=TextConfig(vocab_size=32768, hidden_size=1024, intermediate_size=2816, num_layers=12,
                                         num_heads=16, num_kv_heads=4, head_dim=64))


def checkpoints() -> dict:
    from nxdi_voxtral.synthetic import (damp_dropped_layers, random_state_dict, write_checkpoint,
                                        write_layer_draft, write_random_dflash)
    root = cache_root() / f"specdec-v1-seed{SEED}-damp{DAMP}"
    dirs = {"target": root / "target", "layers": root / "layers", "dflash": root / f"dflash{DFLASH_LAYERS}"}
    cfg = spec_config()
    if not (dirs["layers"] / "model.safetensors").is_file():
        write_checkpoint(dirs["target"], cfg, damp_dropped_layers(random_state_dict(cfg, SEED, STD), KEEP, DAMP))
        write_layer_draft(dirs["target"], dirs["layers"], KEEP)
    if not (dirs["dflash"] / "model.safetensors").is_file():
        write_random_dflash(dirs["dflash"], cfg, target_layer_ids=DFLASH_TARGET_IDS, num_layers=DFLASH_LAYERS,
                            seed=SEED)
    return dirs


def load(kind: str, k: int | None, dtype=torch.float32):
    from nxdi_voxtral import Buckets, NxDVoxtralSpecDec
    plain = kind == "plain"
    return NxDVoxtralSpecDec.from_pretrained(checkpoints()["target"], draft=None if plain else checkpoints().get(kind),
                                             draft_kind=None if plain else kind, num_speculative_tokens=k,
                                             dtype=dtype, buckets=Buckets(audio_chunks=(1,), kv_lengths=(KV,)))


def prompt(m):
    return m.prepare(test_audio(30.0), language="en", sampling_rate=16000)


# ---------------------------------------------------------------- graph calls and the work they do

def call_fns(m, position: int, verify_rows=(), bucket: int = KV, batch: int = 1) -> dict:
    """Closures of single graph calls at a KV bucket: decode, verify (at the model's K+1 rows, or at each of
    verify_rows rows per sequence), and the model's draft call. batch: sequences per call (KV slots 0..batch-1, each
    at `position`; the model needs that batch bucket). Through the in-process engine where there is one (so a verify
    of any width runs on the one verify module), else m.run (tp > 1: the compiled K+1 only)."""
    from nxdi_voxtral.generate import I32, cache_masks
    from nxdi_voxtral.speculative import ngram_propose
    run, s, k, b = (m.engine.run if m.engine is not None else m.run), m.setup, m.setup.k, batch
    i = lambda v: torch.tensor(v, dtype=I32)  # noqa: E731
    rows = lambda v: i([v] * b)  # noqa: E731 - the same row for every sequence
    slots, mask = i(list(range(b))), cache_masks(bucket, [position] * b)
    fns = {"decode": lambda: run("token_generation", bucket, rows([5]), rows(position), mask, slots)}
    for r in verify_rows or ((k + 1,) if s.draft_kind else ()):
        fns[f"verify {r}"] = (lambda r: lambda: run("verify", bucket, rows([5] * r),
                                                    rows(list(range(position, position + r))), mask, rows(r - 1),
                                                    slots))(r)
    if s.draft_kind == "layers":
        fns["draft"] = lambda: run("draft_fused_k", bucket, rows([5, 6]), rows([position - 1, position]),
                                   cache_masks(bucket, [position - 1] * b), slots)
    elif s.draft_kind == "dflash":
        blk = s.dflash_block
        feats = torch.zeros(b, blk, s.feature_dim, dtype=s.dtype)
        fns["draft"] = lambda: run("dflash_draft", bucket, feats, rows(list(range(position, position + blk))),
                                   rows([5]), rows(position), mask, slots)
    elif s.draft_kind == "ngram":
        hist = list(range(200)) * 2
        fns["draft"] = lambda: [ngram_propose(hist, k) for _ in range(b)]
    return fns


def pmats(*mods) -> int:
    return sum(p.numel() for mod in mods for p in mod.parameters() if p.dim() == 2)


def call_work(m, call: str, rows: int) -> dict:
    """Weight bytes, KV bytes and FLOPs of one call (see the module docstring)."""
    t, lm, head = m.cfg.text, m.model.language_model, m.model.lm_head
    el = lm.k_cache.element_size()
    kv = lambda layers, keys: 2 * layers * t.num_kv_heads * keys * t.head_dim * el  # noqa: E731
    attn = lambda r, layers, keys: 4 * r * t.num_heads * t.head_dim * keys * layers  # noqa: E731
    if call in ("decode", "verify"):
        body = [*lm.layers, lm.norm]
        return dict(weight=weight_bytes(*body, head), kv=kv(t.num_layers, KV),
                    flops=2 * rows * (pmats(*body) + pmats(head)) + attn(rows, t.num_layers, KV))
    k = m.setup.k
    if call == "draft_fused_k":  # K steps; the first feeds 2 rows, each step's LM head takes 1 row
        d = m.draft.language_model
        body, n = [*d.layers, d.norm], len(d.layers)
        return dict(weight=k * weight_bytes(*body, head), kv=k * kv(n, KV),
                    flops=2 * (k + 1) * pmats(*body) + 2 * k * pmats(head) + attn(k + 1, n, KV))
    # dflash_draft: context K/V of `rows` new rows (fc, k/v projections), the block through the layers, LM head on K
    d, n = m.draft, len(m.draft.layers)
    ctx_kv = sum(pmats(layer.self_attn.k_proj, layer.self_attn.v_proj) for layer in d.layers)
    return dict(weight=weight_bytes(d, head), kv=kv(n, KV + rows),
                flops=2 * rows * (pmats(d) + ctx_kv) + 2 * k * pmats(head) + attn(rows, n, KV + rows))


def bench_calls(dtype: str, rounds: int) -> dict:
    """The per-call table's measurements, one process per dtype (fp32 also measures the host)."""
    host = roofline_probe(methods=("sum", "mv", "row_linear"), matmul_dtypes=("fp32", "bf16"), rounds=rounds) \
        if dtype == "fp32" else None
    td = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    layers, dflash = load("layers", 4, td), load("dflash", 15, td)
    position = prompt(layers).input_ids.shape[1] + 48
    fns = call_fns(layers, position, VERIFY_ROWS)
    fns["draft_fused_k"] = fns.pop("draft")
    fns["dflash_draft"] = call_fns(dflash, position)["draft"]
    with OtherCpuLoad() as load_:
        ms = {name: 1e3 * s for name, s in time_calls(fns, rounds).items()}
    rows = [("decode", 1, "decode", layers)] + [(f"verify {r}", r, "verify", layers) for r in VERIFY_ROWS] + \
        [("draft_fused_k", 4, "draft_fused_k", layers), ("dflash_draft", 16, "dflash_draft", dflash)]
    return dict(dtype=dtype, host=host, position=position, peak_rss_mib=peak_rss_mib(), other_cpu=load_.fraction,
                calls=[dict(call=name, rows=r, ms=ms[name], **call_work(m, call, r)) for name, r, call, m in rows])


# ---------------------------------------------------------------- end to end

def plain_greedy(m, p, n: int):
    """Plain greedy on m's target after m's prefill (what generate() does without a draft: m.start, then one
    token_generation step at a time) -> (tokens, decode s). One sequence in KV slot 0."""
    from nxdi_voxtral.generate import decode_step
    seq = m.start(*m.check_inputs(p.input_ids, p.input_features), n, 0)
    free = list(range(1, m.buckets.max_batch))

    def loop():
        while not seq.done:
            decode_step(m.run, [seq], m.buckets, free)
        return seq.tokens
    return timed(loop)


def bench_ours(kind: str, k: int | None, n_new: int, runs: int, rounds: int) -> dict:
    """One configuration: its generate() alternating with plain greedy on the same target weights."""
    m = load(kind, k)
    p = prompt(m)

    def spec(n):
        t = {}
        ids, stats = m.generate(p.input_ids, p.input_features, max_new_tokens=n, timings=t, return_stats=True)
        return ids[0].tolist(), t["decode_s"], stats

    spec(8), plain_greedy(m, p, 8)  # warm-up
    outs = {}
    with OtherCpuLoad() as load_:
        best = time_calls({"plain": lambda: plain_greedy(m, p, n_new), "spec": lambda: spec(n_new)}, runs, warmup=0,
                          seconds=lambda r: r[1], outputs=outs)
        costs = {name.split()[0]: 1e3 * s for name, s in time_calls(call_fns(m, p.input_ids.shape[1] + 48),
                                                                       rounds).items()}
    (plain_tokens, _), (tokens, _, stats) = outs["plain"][-1], outs["spec"][-1]
    best_plain, best_spec = best["plain"], best["spec"]
    n = len(tokens)
    return dict(kind=kind, k=m.setup.k, tau=stats.tau if kind != "plain" else 1.0, tokens_list=tokens,
                plain_tokens=plain_tokens, verify_calls=stats.verify_calls,
                plain_steps=len(stats.steps) - stats.verify_calls, passes_per_token=(stats.target_passes - 1) / (n - 1),
                ms_per_token=1e3 * best_spec / (n - 1), plain_ms_per_token=1e3 * best_plain / (len(plain_tokens) - 1),
                costs=costs, tokens=n, distinct=len(set(tokens)), peak_rss_mib=peak_rss_mib(), other_cpu=load_.fraction)


def bench_hf(n_new: int, runs: int, k: int = 4) -> dict:
    """transformers greedy and assisted generation, alternating with our plain greedy in the same process."""
    from transformers import VoxtralForConditionalGeneration
    dirs = checkpoints()
    ours = load("plain", None)
    p = prompt(ours)
    target = VoxtralForConditionalGeneration.from_pretrained(dirs["target"]).eval()
    draft = VoxtralForConditionalGeneration.from_pretrained(dirs["layers"]).eval()
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0

    def gen(n, assistant=False):
        kw = dict(assistant_model=draft) if assistant else {}
        with torch.no_grad():
            out, s = timed(target.generate, input_ids=p.input_ids, input_features=p.input_features, max_new_tokens=n,
                           do_sample=False, **kw)
        return out[0, p.input_ids.shape[1]:].tolist(), s

    fns = {"ours": lambda: plain_greedy(ours, p, n_new), "one": lambda: gen(1), "greedy": lambda: gen(n_new),
           "assisted": lambda: gen(n_new, True)}
    gen(4, True), plain_greedy(ours, p, 4)  # warm-up
    outs = {}
    with OtherCpuLoad() as load_:
        best = time_calls(fns, runs, warmup=0, seconds=lambda r: r[1], outputs=outs)
    out = {name: o[-1][0] for name, o in outs.items()}
    n = len(out["greedy"])
    per_tok = lambda name: 1e3 * (best[name] - best["one"]) / (n - 1)  # noqa: E731
    return dict(ours_ms_per_token=1e3 * best["ours"] / (len(out["ours"]) - 1), greedy_ms_per_token=per_tok("greedy"),
                assisted_ms_per_token=per_tok("assisted"), ours_tokens=out["ours"], greedy_tokens=out["greedy"],
                assisted_tokens=out["assisted"], k=k, other_cpu=load_.fraction)


# ---------------------------------------------------------------- tables

def calls_table(res: dict, host: dict) -> str:
    bw, peak = host["bandwidth_gbps"], host["peak_gflops"][res["dtype"]]
    roofs = [roofline_ms(c["weight"] + c["kv"], bw, c["flops"], peak) for c in res["calls"]]
    rows = []
    for c, roof in zip(res["calls"], roofs):
        target = {"verify": 1.3 if c["rows"] <= 8 else 1.6, "dflash_draft": 0.6}.get(c["call"].split()[0])
        x = c["ms"] / res["calls"][0]["ms"]
        rows.append([c["call"], c["rows"], c["ms"], x, c["weight"] / 1e6, c["kv"] / 1e6, c["flops"] / 1e9, roof,
                     roof / c["ms"], roof / roofs[0], f"<= {target}x" if target else "-",
                     yes_no(x <= target) if target else "-"])
    return markdown_table(["call", "rows", "ms", "x decode", "weight MB", "KV MB", "GFLOP", "roofline ms",
                           "of roofline", "roofline x decode", "target", "met"], rows)


def e2e_table(ours: list, hf: dict | None) -> str:
    plain, rows = ours[0]["tokens_list"], []
    for r in ours:
        c = r["costs"]
        if "verify" in c:  # verify steps cost verify + draft, n-gram misses one decode
            predicted = r["verify_calls"] * (c["verify"] + c["draft"]) + r["plain_steps"] * c["decode"]
            analytical = (r["tokens"] - 1) * c["decode"] / predicted
        else:
            analytical = 1.0
        speedup = r["plain_ms_per_token"] / r["ms_per_token"]
        k4 = r["kind"] == "layers" and r["k"] == 4
        rows.append([r["kind"], r["k"] if r["kind"] != "plain" else "-", r["tau"] if r["verify_calls"] else "-",
                     r["passes_per_token"], r["ms_per_token"], r["plain_ms_per_token"], speedup, c["decode"],
                     c.get("verify", "-"), c.get("draft", "-"), analytical, speedup / analytical, r["peak_rss_mib"],
                     pct(r["other_cpu"]), "yes", ">= 1.6x" if k4 else "-",
                     yes_no(speedup >= 1.6) if k4 else "-"])
    if hf:
        ratio = hf["ours_ms_per_token"] / hf["greedy_ms_per_token"]
        for name, ms, target in (("transformers greedy", hf["greedy_ms_per_token"], "<= 0.55"),
                                 ("transformers assisted (layers)", hf["assisted_ms_per_token"], "-")):
            tokens = hf["greedy_tokens" if target != "-" else "assisted_tokens"]
            rows.append([name, hf["k"] if target == "-" else "-", "-", "-", ms, hf["ours_ms_per_token"],
                         hf["ours_ms_per_token"] / ms, *["-"] * 6, pct(hf["other_cpu"]),
                         yes_no(tokens == plain), target, yes_no(ratio <= 0.55) if target != "-" else "-"])
    return markdown_table(["draft", "K", "tau", "passes/tok", "ms/tok", "plain ms/tok", "speed-up", "decode ms",
                           "verify ms", "draft ms", "analytical", "loop eff.", "peak RSS MiB", "other CPU",
                           "same tokens", "target", "met"], rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer tokens, runs and configurations")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                    help="bf16: a bf16 per-call table too (child: this process's dtype)")
    ap.add_argument("--json", default=None, help="write every result to this path")
    ap.add_argument("--impl", choices=["calls", "ours", "hf"], default=None)
    ap.add_argument("--kind", default="plain")
    ap.add_argument("-k", type=int, default=None)
    args = ap.parse_args()
    p = QUICK if args.quick else FULL
    if args.impl:
        print(json.dumps(bench_calls(args.dtype, p["rounds"]) if args.impl == "calls" else
                         bench_ours(args.kind, args.k, p["n_new"], p["runs"], p["rounds"]) if args.impl == "ours" else
                         bench_hf(p["n_new"], p["runs"])))
        return
    checkpoints()
    quick = ["--quick"] if args.quick else []
    calls = [run_json_subprocess(MODULE, ["--impl", "calls", "--dtype", d] + quick)
             for d in (["fp32", "bf16"] if args.dtype == "bf16" else ["fp32"])]
    ours = [run_json_subprocess(MODULE, ["--impl", "ours", "--kind", kind] + (["-k", str(k)] if k else []) + quick)
            for kind, k in (QUICK_CONFIGS if args.quick else CONFIGS)]
    hf = run_json_subprocess(MODULE, ["--impl", "hf"] + quick)
    plain = ours[0]["tokens_list"]
    assert all(r["tokens_list"] == plain and r["plain_tokens"] == plain for r in ours), "a draft changed the output"
    assert hf["ours_tokens"] == plain, "plain greedy differs between processes"
    host = calls[0]["host"]
    print(f"host: torch threads {host['threads']}; streaming read "
          + ", ".join(f"{k} {v:.1f} GB/s" for k, v in host["read_gbps"].items())
          + f" -> bandwidth {host['bandwidth_gbps']:.1f} GB/s ({host['bandwidth_method']}); matmul peak "
          + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in host["peak_gflops"].items()))
    for c in calls:
        print(f"\nper call, {c['dtype']}, KV bucket {KV}, position {c['position']} (peak RSS {c['peak_rss_mib']:.0f} "
              f"MiB; other processes' CPU load {pct(c['other_cpu'])}):\n"
              + calls_table(c, host))
    print(f"\nend to end, fp32: {len(plain)} tokens ({len(set(plain))} distinct), identical for every "
          f"configuration: yes\n" + e2e_table(ours, hf))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(calls=calls, ours=ours, hf=hf), indent=1))


if __name__ == "__main__":
    main()
