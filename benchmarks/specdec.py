"""Speculative decoding on CPU: layer draft (K = 2, 4, 8), n-gram and DFlash vs our own plain greedy.

Mid-size random target with Voxtral's proportions (12 layers, hidden 1024, FFN 2816, 16/4 heads, vocab 32768)
whose layers 1..10 are damped (o_proj/down_proj x DAMP), so the 2-layer draft keeping target layers [0, 11]
agrees with it most of the time: controllable acceptance. 30 s of audio, 96 new tokens, fp32, batch 1.

Columns
  tau                 mean(accepted + 1) per verify call;  passes/tok = target passes after prefill / tokens
  ms/tok              decode phase wall time per generated token (median of runs)
  speed-up            our plain greedy ms/tok / this row's ms/tok (measured)
  analytical          tau * t(1-token decode) / (t(verify K+1) + t(draft call)), from per-call costs
                      (n-gram misses are plain decode steps and are costed as such)
  loop eff.           speed-up / analytical (1.0 = no host overhead)
transformers assisted: generate(assistant_model=<same layer draft>, num_assistant_tokens=K, constant schedule),
run in a subprocess (its own peak RSS).

    python -m benchmarks.specdec            (~5 min on 2 cores)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import cache_root, markdown_table, median, peak_rss_mib, run_json_subprocess, test_audio

MODULE = "benchmarks.specdec"
DAMP, KEEP, SEED, STD = 0.02, [0, 11], 0, 0.3
N_NEW, RUNS = 96, 2


def spec_config():
    from nxdi_voxtral.config import AudioEncoderConfig, TextConfig, VoxtralConfig
    return VoxtralConfig(audio=AudioEncoderConfig(hidden_size=256, intermediate_size=1024, num_layers=2, num_heads=4),
                         text=TextConfig(vocab_size=32768, hidden_size=1024, intermediate_size=2816, num_layers=12,
                                         num_heads=16, num_kv_heads=4, head_dim=64))


def checkpoints() -> dict:
    from nxdi_voxtral.synthetic import (damp_dropped_layers, random_state_dict, write_checkpoint,
                                        write_layer_draft, write_random_dflash)
    root = cache_root() / f"specdec-v1-seed{SEED}-damp{DAMP}"
    dirs = {"target": root / "target", "layers": root / "layers", "dflash": root / "dflash"}
    if not (dirs["dflash"] / "model.safetensors").is_file():
        cfg = spec_config()
        write_checkpoint(dirs["target"], cfg, damp_dropped_layers(random_state_dict(cfg, SEED, STD), KEEP, DAMP))
        write_layer_draft(dirs["target"], dirs["layers"], KEEP)
        write_random_dflash(dirs["dflash"], cfg, target_layer_ids=(0, 5, 11), num_layers=1, seed=SEED)
    return dirs


def prompt(m):
    return m.prepare(test_audio(30.0), language="en", sampling_rate=16000)


def per_call_ms(fn, n=8) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * median(times)


def call_costs(m, position: int) -> dict:
    """Median wall time of single graph calls at the bucket the benchmark runs in."""
    from nxdi_voxtral.generate import I32, cache_mask
    b = m.buckets.kv_lengths[0]
    i = lambda *v: torch.tensor(v, dtype=I32)  # noqa: E731
    s, k = m.setup, m.setup.k
    costs = {"decode": per_call_ms(lambda: m.run("token_generation", b, i([5]), i(position), cache_mask(b, position)))}
    if s.draft_kind:
        costs["verify"] = per_call_ms(lambda: m.run("verify", b, i([5] * (k + 1)), i(list(range(position, position + k + 1))),
                                                    cache_mask(b, position), i(k)))
    if s.draft_kind == "layers":
        costs["draft"] = per_call_ms(lambda: m.run("draft_fused_k", b, i([5, 6]), i([position - 1, position]),
                                                   cache_mask(b, position - 1)))
    elif s.draft_kind == "dflash":
        costs["draft"] = per_call_ms(lambda: m.run(
            "dflash_draft", b, torch.zeros(1, s.dflash_block, s.feature_dim), i(list(range(position, position + 16))),
            i([5]), i(position), cache_mask(b, position)))
    elif s.draft_kind == "ngram":
        from nxdi_voxtral.speculative import ngram_propose
        hist = list(range(200)) * 2
        costs["draft"] = per_call_ms(lambda: ngram_propose(hist, k), n=50)
    return costs


CONFIGS = [("plain", None)] + [("layers", k) for k in (2, 4, 8)] + [("ngram", 4), ("dflash", None)]


def bench_ours(kind: str, k: int | None) -> dict:
    """One configuration, in its own process: its peak RSS is its own."""
    from nxdi_voxtral import Buckets, NxDVoxtralSpecDec
    dirs = checkpoints()
    buckets = Buckets(audio_chunks=(1,), kv_lengths=(512,))
    m = NxDVoxtralSpecDec.from_pretrained(dirs["target"], draft=dirs.get(kind), num_speculative_tokens=k,
                                          draft_kind=None if kind == "plain" else kind, buckets=buckets)
    p = prompt(m)
    m.generate(p.input_ids, p.input_features, max_new_tokens=8)  # warm-up
    runs = []
    for _ in range(RUNS):
        t = {}
        ids, stats = m.generate(p.input_ids, p.input_features, max_new_tokens=N_NEW, timings=t, return_stats=True)
        runs.append((ids[0].tolist(), stats, t))
    tokens, stats = runs[-1][0], runs[-1][1]
    n = len(tokens)
    return dict(kind=kind, k=m.setup.k, tau=stats.tau if kind != "plain" else 1.0, tokens_list=tokens,
                verify_calls=stats.verify_calls, plain_steps=len(stats.steps) - stats.verify_calls,
                passes_per_token=(stats.target_passes - 1) / (n - 1),
                ms_per_token=1e3 * median(r[2]["decode_s"] / (n - 1) for r in runs),
                costs=call_costs(m, p.input_ids.shape[1] + 48), tokens=n, distinct=len(set(tokens)),
                peak_rss_mib=peak_rss_mib())


def bench_hf(k: int) -> dict:
    from transformers import VoxtralForConditionalGeneration
    from nxdi_voxtral import Buckets, NxDVoxtralSpecDec
    dirs = checkpoints()
    p = prompt(NxDVoxtralSpecDec.from_pretrained(dirs["target"], buckets=Buckets(audio_chunks=(1,), kv_lengths=(512,))))
    target = VoxtralForConditionalGeneration.from_pretrained(dirs["target"]).eval()
    draft = VoxtralForConditionalGeneration.from_pretrained(dirs["layers"]).eval()
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0

    def gen(n, assistant):
        kw = dict(assistant_model=draft) if assistant else {}
        with torch.no_grad():
            t0 = time.perf_counter()
            out = target.generate(input_ids=p.input_ids, input_features=p.input_features, max_new_tokens=n,
                                  do_sample=False, **kw)
        return out[0, p.input_ids.shape[1]:].tolist(), time.perf_counter() - t0

    gen(4, True)
    tokens, t_all = gen(N_NEW, True)
    _, t_one = gen(1, False)  # prefill
    _, t_plain = gen(N_NEW, False)
    n = len(tokens)
    return {"tokens": tokens, "assisted_ms_per_token": 1e3 * (t_all - t_one) / (n - 1),
            "greedy_ms_per_token": 1e3 * (t_plain - t_one) / (n - 1), "peak_rss_mib": peak_rss_mib()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["ours", "hf"], default=None)
    ap.add_argument("--kind", default="plain")
    ap.add_argument("-k", type=int, default=None)
    args = ap.parse_args()
    if args.impl == "ours":
        print(json.dumps(bench_ours(args.kind, args.k)))
        return
    if args.impl == "hf":
        print(json.dumps(bench_hf(args.k)))
        return
    checkpoints()
    ours = [run_json_subprocess(MODULE, ["--impl", "ours", "--kind", kind] + (["-k", str(k)] if k else []))
            for kind, k in CONFIGS]
    hf = run_json_subprocess(MODULE, ["--impl", "hf", "-k", "4"])
    plain = ours[0]
    assert all(r["tokens_list"] == plain["tokens_list"] for r in ours), "a draft changed the output"
    rows = []
    for r in ours:
        c = r["costs"]
        # predicted decode time from per-call costs: verify steps cost verify + draft, n-gram misses one decode
        if "verify" in c:
            predicted = r["verify_calls"] * (c["verify"] + c["draft"]) + r["plain_steps"] * c["decode"]
            analytical = (r["tokens"] - 1) * c["decode"] / predicted
        else:
            analytical = 1.0
        speedup = plain["ms_per_token"] / r["ms_per_token"]
        rows.append([r["kind"], r["k"] if r["kind"] != "plain" else "-", r["tau"] if r["verify_calls"] else "-",
                     r["passes_per_token"], 1 / r["tau"] if r["tau"] else "-", r["ms_per_token"], speedup, c["decode"], c.get("verify", "-"), c.get("draft", "-"),
                     analytical, speedup / analytical, r["peak_rss_mib"]])
    print(f"torch threads: {torch.get_num_threads()}; {plain['tokens']} tokens "
          f"({plain['distinct']} distinct); identical output for every row: yes")
    print(markdown_table(["draft", "K", "tau", "passes/tok", "1/tau", "ms/tok", "speed-up", "decode ms",
                          "verify ms", "draft ms", "analytical", "loop eff.", "peak RSS MiB"], rows))
    same = hf["tokens"] == plain["tokens_list"]
    layer4 = next(r for r in ours if r["kind"] == "layers" and r["k"] == 4)
    print()
    print(markdown_table(
        ["implementation (layer draft, K=4)", "ms/tok", "vs transformers assisted", "same tokens", "peak RSS MiB"],
        [["ours (verify graph + fused-K draft)", layer4["ms_per_token"],
          hf["assisted_ms_per_token"] / layer4["ms_per_token"], "yes", layer4["peak_rss_mib"]],
         ["transformers generate(assistant_model=...)", hf["assisted_ms_per_token"], 1.0, "yes" if same else "NO",
          hf["peak_rss_mib"]],
         ["transformers greedy (reference)", hf["greedy_ms_per_token"], hf["assisted_ms_per_token"] /
          hf["greedy_ms_per_token"], "-", "-"]]))


if __name__ == "__main__":
    main()
