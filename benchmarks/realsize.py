"""Real-size Voxtral-Mini-3B-2507 on this CPU in bf16: ours (greedy, layer-draft speculation, tp 2 over gloo) vs
transformers, against a memory-bandwidth roofline measured in the same run.

Checkpoint: random weights with the real configuration (30 x 3072 decoder, vocab 131072, untied head; audio encoder
32 x 1280), written once into the benchmark cache (common.cache_root(), keyed by config, seed, scales and this
writer's code; atomic rename) in the HF layout (config.json, tekken.json, model-0000i-of-00005.safetensors + index),
bf16, ~9.4 GB. Tensor by tensor (each seeded by its name, drawn in chunks), each shard streamed to disk: the state
dict is never in memory. Scales as synthetic.random_state_dict (decoder std 0.3, audio std 0.05, norms 1 + 0.1 N);
target layers outside the draft's [0, 10, 20, 29] have o_proj / down_proj scaled by --damp (0.02, as specdec.py and
cuda_realsize.py), so the 4-layer pruned draft agrees often (tau is the damping recipe's, not real weights').
Shard 1 holds what the draft shares (embeddings, LM head, audio tower, projector); the draft dir (`layers/`) holds a
hard link to it plus its own shard (the 4 kept layers renumbered, the final norm): nothing shared is on disk twice.

Rows (each in its own child process, so peak RSS is per configuration; one heavy process at a time):
  ours greedy tp1       NxDVoxtralSpecDec.from_pretrained(dtype=bf16) + generate
  transformers          VoxtralForConditionalGeneration.from_pretrained(dtype=bf16) + generate(do_sample=False)
  ours spec K=2 / K=4   + draft=layers/ (draft_kind="layers")
  ours greedy tp2       tp_degree=2: two rank processes (gloo), one thread each
Columns
  load s            from_pretrained wall time (warm page cache: the checkpoint was just written or read)
  prefill s         ours: generate's prefill_s (audio encoder + context encoding [+ draft prefill]);
                    transformers: generate start -> first new token (a streamer's timestamps)
  decode ms/tok     decode phase / (new tokens - 1); transformers: first -> last new token / (N - 1)
  x roofline        decode ms/tok / roofline ms, roofline = bf16 bytes of decoder layers + final norm + LM head
                    (read once per token; KV and the embedding row left out) / streaming-read bandwidth
  x transformers    decode ms/tok / transformers' decode ms/tok (below 1: faster)
  tau               tokens emitted per verify call; speed-up = greedy tp1 decode ms/tok / this row's;
                    analytical = tau x t(decode step) / (t(verify) + t(draft K steps)), per-call costs of this row's
                    own process (steadier than speed-up where the machine's bandwidth drifts between processes)
  verify/dec, draft/dec  per-call cost (median of --cost-calls single graph calls after one warm-up) of a K+1-row
                    verify and of the fused K-step draft, over one token_generation step (specdec.call_fns's calls)
  peak RSS GiB      VmHWM at the end of the run (tp2: the largest rank; the host process is listed apart)
  load peak/weights VmHWM right after loading / bytes of weights the process (rank) holds (shared counted once)

    python -m benchmarks.realsize                          # real size, 30 s audio, 32 tokens, every row (~6 min)
    python -m benchmarks.realsize --long --wait-idle 3600 --retry-noisy 3 --json out.json
                                       # + 2 min of audio (~14 min on 2 idle cores); on a shared machine each row
                                       # waits for idle CPUs and is rerun when other processes used > 10% of them
    python -m benchmarks.realsize --report out.json        # the tables of a saved run
    python -m benchmarks.realsize --config mid             # mid-size model (decoder 1024 x 8), fast, for development
    python -m benchmarks.realsize --only greedy,spec --skip-transformers --tokens 16 --seconds 30
    python -m benchmarks.realsize --write-only             # just write (or find) the checkpoint (~1 min, 10.2 GB)
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import os
import shutil
import struct
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nxdi_voxtral.eval.divergence import first_divergence

from benchmarks.common import (REALSIZE_DRAFT_LAYERS, OtherCpuLoad, cache_root, cpu_busy_fraction, load_inputs,
                               make_inputs, markdown_table, median, mid_config, pct, proc_mem_gib, realsize_config,
                               roofline_ms, roofline_probe, run_json_subprocess, save_inputs, time_calls, timed,
                               weight_bytes)

MODULE = "benchmarks.realsize"
SEED, STD, AUDIO_STD, DAMP = 0, 0.3, 0.05, 0.02
SHARDS = 5
NOISY = 0.10             # other processes' share of the CPUs above which a row's timings are called noisy
CHUNK = 1 << 24          # elements drawn per randn call (64 MiB of fp32)
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[realsize {time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def bench_config(name: str):
    """-> (VoxtralConfig, draft keep layers)."""
    if name == "real":
        return realsize_config(), list(REALSIZE_DRAFT_LAYERS)
    return mid_config(), [0, 3, 5, 7]


# ---------------------------------------------------------------- streaming checkpoint writer

def hf_plan(cfg) -> list[tuple[str, str, tuple]]:
    """(HF file key, our module key, shape) for every tensor the model loads, without allocating any."""
    from nxdi_voxtral.model import VoxtralModel
    with torch.device("meta"):
        model = VoxtralModel(cfg, max_len=1)
    out = []
    for k, p in model.state_dict().items():
        if k.startswith("language_model."):
            hf = "language_model.model." + k[len("language_model."):]
        elif k.startswith("lm_head."):
            hf = "language_model." + k
        else:
            hf = k
        out.append((hf, k, tuple(p.shape)))
    return out


def recipe(ours: str, keep: list[int], std: float, audio_std: float, damp: float) -> tuple[float, float, float]:
    """(base, scale, factor): value = (base + scale * N(0, 1)) * factor; synthetic.random_state_dict's scales,
    damp_dropped_layers' factor."""
    if ours.startswith("language_model") and ours.endswith("norm.weight"):
        base, scale = 1.0, 0.1
    elif "layer_norm" in ours:
        base, scale = (1.0 if ours.endswith("weight") else 0.0), 0.1
    else:
        base, scale = 0.0, (audio_std if ours.startswith("audio_tower") else std)
    factor = 1.0
    parts = ours.split(".")
    if ours.startswith("language_model.layers.") and int(parts[2]) not in keep and \
            ours.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
        factor = damp
    return base, scale, factor


def tensor_seed(seed: int, hf_key: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{hf_key}".encode()).digest()[:8], "little") & (2**63 - 1)


def draw_chunks(hf_key: str, numel: int, base: float, scale: float, factor: float, seed: int):
    """The tensor's values in bf16, flat, CHUNK elements at a time (same name and seed -> same bytes)."""
    g = torch.Generator().manual_seed(tensor_seed(seed, hf_key))
    for start in range(0, numel, CHUNK):
        x = torch.randn(min(CHUNK, numel - start), generator=g)
        if scale != 1.0:
            x.mul_(scale)
        if base:
            x.add_(base)
        if factor != 1.0:
            x.mul_(factor)
        yield x.to(torch.bfloat16)


def write_safetensors(path: Path, entries: list, seed: int, bar) -> None:
    """entries: (file key, shape, (base, scale, factor), source key for the seed). Header first (offsets are known
    from the shapes), then each tensor's bytes streamed in chunks."""
    header, off = {}, 0
    for key, shape, _, _ in entries:
        n = math.prod(shape) * 2
        header[key] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for key, shape, (base, scale, factor), src in entries:
            for chunk in draw_chunks(src, math.prod(shape), base, scale, factor, seed):
                b = chunk.view(torch.uint8).numpy()
                f.write(b.data)
                bar.update(b.nbytes)


def layer_of(hf_key: str) -> int | None:
    p = "language_model.model.layers."
    return int(hf_key[len(p):].split(".")[0]) if hf_key.startswith(p) else None


SHARED_PREFIXES = ("audio_tower.", "multi_modal_projector.", "language_model.model.embed_tokens.",
                   "language_model.lm_head.")


def write_index(d: Path, files: dict[str, list]) -> None:
    weight_map = {e[0]: name for name, es in files.items() for e in es}
    total = sum(math.prod(e[1]) * 2 for es in files.values() for e in es)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                "weight_map": weight_map}, indent=1))


def write_bench_checkpoint(root: Path, cfg, keep: list[int], seed: int, std: float, audio_std: float,
                           damp: float, shards: int = SHARDS) -> None:
    """root/target (shards files) and root/layers (the 4-layer draft: shard 1 hard-linked, its own layers)."""
    from tqdm import tqdm
    from nxdi_voxtral.synthetic import hf_config_dict, write_tokenizer
    plan = hf_plan(cfg)
    rec = {hf: (shape, recipe(ours, keep, std, audio_std, damp)) for hf, ours, shape in plan}
    entry = lambda hf, src=None: (hf, rec[src or hf][0], rec[src or hf][1], src or hf)  # noqa: E731
    shared = sorted(hf for hf in rec if hf.startswith(SHARED_PREFIXES))
    rest = sorted((hf for hf in rec if not hf.startswith(SHARED_PREFIXES)),
                  key=lambda k: (layer_of(k) if layer_of(k) is not None else 10**6, k))
    # shard 1: the shared tensors; the decoder layers (+ final norm) split by bytes over the other shards
    per = sum(math.prod(rec[k][0]) for k in rest) / (shards - 1)
    groups, acc = [[] for _ in range(shards - 1)], 0
    for k in rest:
        groups[min(int(acc // per), shards - 2)].append(k)
        acc += math.prod(rec[k][0])
    files = {f"model-{i + 1:05d}-of-{shards:05d}.safetensors": [entry(k) for k in g]
             for i, g in enumerate([shared] + groups)}
    prefix = "language_model.model.layers."
    own = [entry(f"{prefix}{new}." + k[len(f"{prefix}{old}."):], k)
           for new, old in enumerate(keep) for k in rest if layer_of(k) == old]
    own += [entry(k) for k in rest if layer_of(k) is None]  # final norm: the draft's own (not shared by the loader)
    draft_files = {"model-00001-of-00002.safetensors": files[f"model-00001-of-{shards:05d}.safetensors"],
                   "model-00002-of-00002.safetensors": own}
    total = sum(math.prod(e[1]) * 2 for es in (*files.values(), own) for e in es)
    target, layers = root / "target", root / "layers"
    target.mkdir(parents=True)
    layers.mkdir()
    (target / "config.json").write_text(json.dumps(hf_config_dict(cfg), indent=2))
    write_tokenizer(target, cfg.text.vocab_size)
    draft_cfg = replace(cfg, text=replace(cfg.text, num_layers=len(keep)))
    (layers / "config.json").write_text(json.dumps(hf_config_dict(draft_cfg), indent=2))
    shutil.copy(target / "tekken.json", layers / "tekken.json")
    log(f"writing {total / 1e9:.2f} GB of bf16 weights into {root}")
    with tqdm(total=total, unit="B", unit_scale=True, desc="checkpoint", file=sys.stderr, mininterval=2) as bar:
        for name, es in files.items():
            write_safetensors(target / name, es, seed, bar)
        write_safetensors(layers / "model-00002-of-00002.safetensors", own, seed, bar)
    first = f"model-00001-of-{shards:05d}.safetensors"
    try:
        os.link(target / first, layers / "model-00001-of-00002.safetensors")
    except OSError:
        shutil.copy(target / first, layers / "model-00001-of-00002.safetensors")
    write_index(target, files)
    write_index(layers, draft_files)


def bench_checkpoint(config: str, seed: int = SEED, damp: float = DAMP) -> dict[str, Path]:
    """The cached checkpoint (written once; atomic rename, safe to race) -> {"target": dir, "layers": dir}."""
    cfg, keep = bench_config(config)
    from nxdi_voxtral import synthetic
    code = "".join(inspect.getsource(f) for f in (hf_plan, recipe, tensor_seed, draw_chunks, write_safetensors,
                                                  write_bench_checkpoint, synthetic.hf_config_dict,
                                                  synthetic.write_tokenizer))
    key = json.dumps({"cfg": asdict(cfg), "keep": keep, "seed": seed, "std": STD, "audio_std": AUDIO_STD,
                      "damp": damp, "shards": SHARDS, "chunk": CHUNK, "code": code}, sort_keys=True)
    final = cache_root() / f"realsize-{config}-bf16-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    dirs = {"target": final / "target", "layers": final / "layers"}
    if (dirs["layers"] / "model.safetensors.index.json").is_file():
        log(f"checkpoint cached: {final}")
        return dirs
    final.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(final.parent).free
    need = sum(math.prod(s) * 2 for _, _, s in hf_plan(cfg)) * 1.15
    if free < need:
        raise SystemExit(f"{final.parent}: {free / 1e9:.1f} GB free, the checkpoint needs {need / 1e9:.1f} GB")
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".building-"))
    try:
        write_bench_checkpoint(tmp, cfg, keep, seed, STD, AUDIO_STD, damp)
        tmp.rename(final)
    except OSError:
        if not (dirs["layers"] / "model.safetensors.index.json").is_file():
            raise
        log("another process wrote the checkpoint first")  # it won the race
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dirs


# ---------------------------------------------------------------- machine ceilings (parent, before any child)

def stream_read_gbs(gib: float = 2.0, reps: int = 5) -> float:
    """Streaming-read bandwidth: common.roofline_probe's `t.sum()` over a `gib` GiB fp32 tensor, best of `reps`
    (all torch threads)."""
    return roofline_probe(read_gib=gib, methods=("sum",), matmul_n=None, rounds=reps)["bandwidth_gbps"]


def bf16_gemm_gbs(cfg, cols: int = 16, reps: int = 5) -> float:
    """Weight bytes / time of one bf16 [intermediate x hidden] @ [hidden x cols] product, best of `reps`: the
    shape of a decode step's MLP products on torch's kernels (the torch twin pads bf16 rows to 16 columns)."""
    w = torch.randn(cfg.text.intermediate_size, cfg.text.hidden_size).to(torch.bfloat16)
    x = torch.randn(cfg.text.hidden_size, cols).to(torch.bfloat16)
    return w.nbytes / time_calls(lambda: w @ x, reps) / 1e9


def decode_bytes(cfg) -> dict[str, int]:
    """bf16 bytes a decode step reads once: decoder layers + final norm, LM head (common.weight_bytes of a
    meta-device model: nothing allocated)."""
    from nxdi_voxtral.model import VoxtralModel
    with torch.device("meta"):
        model = VoxtralModel(cfg, max_len=1).to(torch.bfloat16)
    lm = model.language_model
    return {"decoder": weight_bytes(lm.layers, lm.norm), "lm_head": weight_bytes(model.lm_head)}


# ---------------------------------------------------------------- buckets

def buckets_for(n_chunks: int, prompt_len: int, tokens: int, cfg):
    """One audio bucket, one KV bucket (the smallest power of two >= 512 holding prompt + tokens + K + 16)."""
    from nxdi_voxtral import Buckets
    b = Buckets(audio_chunks=(n_chunks,), kv_lengths=(512,))
    need = max(prompt_len, b.prompt_length(n_chunks, cfg)) + tokens + 16 + 1
    return Buckets(audio_chunks=(n_chunks,), kv_lengths=(max(512, 1 << (need - 1).bit_length()),))


# ---------------------------------------------------------------- children: one configuration per process

def _progress(label: str, total: int, t_start: float):
    """on_tokens callback: logs the end of prefill and decode progress to stderr."""
    state = {"n": 0, "t1": None}

    def on_tokens(new):
        state["n"] += len(new)
        now = time.perf_counter()
        if state["t1"] is None:
            state["t1"] = now
            log(f"{label}: prefill done in {now - t_start:.1f} s; decoding {total} tokens")
        elif state["n"] % 8 < len(new) or state["n"] >= total:
            log(f"{label}: {state['n']}/{total} tokens, {1e3 * (now - state['t1']) / (state['n'] - 1):.0f} ms/token")
    return on_tokens


def call_costs(m, position: int, n: int) -> dict:
    """specdec.call_fns's single graph calls at the one KV bucket (token_generation; with a layer draft the K+1-row
    verify and draft_fused_k), ms, median of n after one warm-up, one call after another."""
    from benchmarks.specdec import call_fns
    names = {"decode": "decode", f"verify {m.setup.k + 1}": "verify", "draft": "draft"}
    fns = call_fns(m, position, bucket=m.buckets.kv_lengths[0])
    return {names[name]: 1e3 * time_calls(fn, n, reduce=median) for name, fn in fns.items() if name in names}


def child_ours(args) -> dict:
    from nxdi_voxtral import NxDVoxtralSpecDec
    ids, feats = load_inputs(args.inputs)
    cfg, _ = bench_config(args.config)
    buckets = buckets_for(feats.shape[0], ids.shape[1], args.tokens, cfg)
    label = args.child
    log(f"{label}: loading {'target + layer draft' if args.k else 'target'} (bf16, tp {args.tp}, buckets "
        f"{buckets.audio_chunks} chunks / KV {buckets.kv_lengths})")
    m, load_s = timed(NxDVoxtralSpecDec.from_pretrained, args.target, draft=args.draft if args.k else None,
                      draft_kind="layers" if args.k else None, num_speculative_tokens=args.k,
                      dtype=torch.bfloat16, buckets=buckets, tp_degree=args.tp)
    with m:
        pids = m.ranks.pids or ["self"]
        weights = m.ranks.call("weight_bytes")
        at_load = [proc_mem_gib(p) for p in pids]
        host_at_load = proc_mem_gib()
        shared = list(m.engine.draft_shared) if m.engine is not None else None
        log(f"{label}: loaded in {load_s:.1f} s; per rank: " + "; ".join(
            f"weights {w / 2**30:.2f} GiB, peak RSS {a.get('VmHWM', 0):.2f} GiB (anon {a.get('RssAnon', 0):.2f} + "
            f"file {a.get('RssFile', 0):.2f} now)" for w, a in zip(weights, at_load)))
        t = {}
        t_start = time.perf_counter()
        out, stats = m.generate(ids, feats, max_new_tokens=args.tokens, timings=t, return_stats=True,
                                on_tokens=_progress(label, args.tokens, t_start))
        tokens = out[0].tolist()
        n = len(tokens)
        log(f"{label}: per-call costs ({args.cost_calls} calls each)")
        costs = call_costs(m, ids.shape[1] + n // 2, args.cost_calls)
        at_end = [proc_mem_gib(p) for p in pids]
        res = dict(row=label, impl="ours", tp=args.tp, k=args.k, tokens=tokens, load_s=load_s,
                   prefill_s=t["prefill_s"], decode_ms_per_token=1e3 * t["decode_s"] / max(n - 1, 1),
                   tau=stats.tau if args.k else None, acceptance=stats.acceptance_rate if args.k else None,
                   target_passes=stats.target_passes, costs=costs, weight_bytes=weights, mem_at_load=at_load,
                   mem_at_end=at_end, host_mem=proc_mem_gib(), host_mem_at_load=host_at_load,
                   draft_shared=shared, buckets=[list(buckets.audio_chunks), list(buckets.kv_lengths)])
    return res


def child_transformers(args) -> dict:
    from transformers import VoxtralForConditionalGeneration
    from transformers.generation.streamers import BaseStreamer
    from nxdi_voxtral.config import VoxtralConfig
    ids, feats = load_inputs(args.inputs)
    eos = VoxtralConfig.from_dir(args.target).text.eos_token_id
    log("transformers: loading (bf16)")
    model, load_s = timed(VoxtralForConditionalGeneration.from_pretrained, args.target, dtype=torch.bfloat16)
    model.eval()
    weights = weight_bytes(model)
    at_load = proc_mem_gib()
    log(f"transformers: loaded in {load_s:.1f} s; weights {weights / 2**30:.2f} GiB, peak RSS "
        f"{at_load.get('VmHWM', 0):.2f} GiB")
    class Clock(BaseStreamer):
        """put() gets the prompt first, then each new token: timestamps of the first and last new token."""
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())
            if len(self.times) > 1:
                progress([0] * value.numel())

        def end(self):
            pass

    clock = Clock()
    with torch.inference_mode():
        t_start = time.perf_counter()
        progress = _progress("transformers", args.tokens, t_start)
        out = model.generate(input_ids=ids, input_features=feats.to(torch.bfloat16), max_new_tokens=args.tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos, streamer=clock)
        t_end = time.perf_counter()
    tokens = out[0, ids.shape[1]:].tolist()
    n = len(tokens)
    first, last = clock.times[1], clock.times[-1]
    return dict(row="transformers", impl="transformers", tp=1, k=None, tokens=tokens, load_s=load_s,
                prefill_s=first - t_start, decode_ms_per_token=1e3 * (last - first) / max(n - 1, 1),
                e2e_s=t_end - t_start, weight_bytes=[weights], mem_at_load=[at_load], mem_at_end=[proc_mem_gib()],
                attn_impl=model.config._attn_implementation, transformers=__import__("transformers").__version__)


def child(args) -> None:
    import resource
    res = child_transformers(args) if args.child == "transformers" else child_ours(args)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    res.update(threads=torch.get_num_threads(), torch=torch.__version__, major_faults=ru.ru_majflt,
               cpu_s=ru.ru_utime + ru.ru_stime)
    print(json.dumps(res))


# ---------------------------------------------------------------- parent

def rows_wanted(args) -> list[tuple[str, int, int | None]]:
    """(row label, tp, K) in run order."""
    only = set(args.only.split(",")) if args.only else None
    want = lambda name: only is None or name in only  # noqa: E731
    rows = []
    if want("greedy"):
        rows.append(("greedy tp1", 1, None))
    if want("transformers") and not args.skip_transformers:
        rows.append(("transformers", 1, None))
    for k in args.k:
        if want("spec") or want(f"spec{k}"):
            rows.append((f"spec K={k}", 1, k))
    if want("tp2") and not args.skip_tp2:
        rows.append(("greedy tp2", 2, None))
    return rows


def wait_idle(max_wait_s: float, threshold: float = 0.15) -> float | None:
    """Before a row: wait (up to max_wait_s) until other processes use < threshold of the CPUs (2 s samples);
    on 2 cores an oversubscribed OpenMP pool slows several-fold. -> the last busy fraction."""
    deadline, busy = time.monotonic() + max_wait_s, cpu_busy_fraction(2.0)
    while busy is not None and busy >= threshold and time.monotonic() < deadline:
        log(f"machine busy ({100 * busy:.0f}% of the CPUs used by other processes): waiting "
            f"(up to {deadline - time.monotonic():.0f} s more; --wait-idle)")
        time.sleep(20)
        busy = cpu_busy_fraction(2.0)
    return busy


def same_tokens(a: list, b: list) -> str:
    i = first_divergence(a, b)
    return "yes" if i is None else f"no (first divergence at {i})"


def parent(args) -> None:
    t_start = time.perf_counter()
    cfg, keep = bench_config(args.config)
    dirs = bench_checkpoint(args.config, args.seed, args.damp)
    if args.write_only:
        print(dirs["target"])
        return
    busy = wait_idle(args.wait_idle) if args.wait_idle else cpu_busy_fraction(1.0)
    nbytes = decode_bytes(cfg)
    ceilings = []  # (streaming-read GB/s, bf16 GEMM GB/s), at the start and before every row: the best counts

    def measure_ceilings() -> None:
        bw, gemm = stream_read_gbs(), bf16_gemm_gbs(cfg)
        ceilings.append((bw, gemm))
        log(f"bandwidth {bw:.1f} GB/s (roofline {roofline_ms(sum(nbytes.values()), bw):.0f} ms/token for "
            f"{sum(nbytes.values()) / 1e9:.2f} GB per token); bf16 GEMM {gemm:.1f} GB/s")

    log("measuring streaming-read bandwidth (2 GiB fp32 sum) and a bf16 decode-shaped GEMM")
    measure_ceilings()
    results = {"config": args.config, "cfg": asdict(cfg), "draft_layers": keep, "damp": args.damp,
               "checkpoint": str(dirs["target"].parent), "decode_bytes": nbytes, "tokens": args.tokens,
               "cpu_busy_before": busy, "cpus": os.cpu_count(), "torch": torch.__version__, "code": code_state(),
               "runs": {}}
    for seconds in args.seconds:
        with tempfile.TemporaryDirectory() as tmp:
            inputs = Path(tmp) / "inputs.pt"
            ids, feats = make_inputs(dirs["target"], seconds)
            save_inputs(inputs, ids, feats)
            common = ["--config", args.config, "--target", str(dirs["target"]), "--draft", str(dirs["layers"]),
                      "--inputs", str(inputs), "--tokens", str(args.tokens), "--cost-calls", str(args.cost_calls)]
            res = {}
            for label, tp, k in rows_wanted(args):
                log(f"--- {seconds:g} s audio ({ids.shape[1]} prompt tokens): {label}")
                extra = ["--tp", str(tp)] + (["--child-k", str(k)] if k else [])
                for attempt in range(args.retry_noisy + 1):
                    busy_before = wait_idle(args.wait_idle) if args.wait_idle else None
                    measure_ceilings()
                    t_row = time.perf_counter()
                    try:
                        with OtherCpuLoad() as others:
                            r = run_json_subprocess(MODULE, ["--child", label, *extra, *common])
                        r["other_cpu"], r["busy_before"] = others.fraction, busy_before
                        r["wall_s"], r["attempts"] = time.perf_counter() - t_row, attempt + 1
                    except Exception as e:  # noqa: BLE001 - one failed row must not lose the others
                        log(f"{label}: FAILED: {str(e)[-600:]}")
                        r = {"row": label, "error": str(e)[-2000:]}
                        break
                    if (r["other_cpu"] or 0) <= NOISY or attempt == args.retry_noisy:
                        break
                    log(f"{label}: other processes used {100 * r['other_cpu']:.0f}% of the CPUs during the row: "
                        f"running it again (--retry-noisy {args.retry_noisy})")
                res[label] = r
        results["runs"][f"{seconds:g}"] = {"prompt_tokens": ids.shape[1], "chunks": feats.shape[0], "rows": res}
    bw, gemm = max(c[0] for c in ceilings), max(c[1] for c in ceilings)
    results.update(bandwidth_gbs=bw, bf16_gemm_gbs=gemm, ceilings=ceilings,
                   roofline_ms=roofline_ms(nbytes["decoder"] + nbytes["lm_head"], bw),
                   wall_s=time.perf_counter() - t_start, threads=torch.get_num_threads())
    results["text"] = text = render(results)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
        log(f"wrote {args.json}")


def render(results: dict) -> str:
    """The markdown report of a run (also: --report JSON re-renders a saved run)."""
    cfg = type(realsize_config())(**{k: v for k, v in results["cfg"].items() if k not in ("audio", "text")},
                                  audio=type(realsize_config().audio)(**results["cfg"]["audio"]),
                                  text=type(realsize_config().text)(**results["cfg"]["text"]))
    nbytes, ceilings, bw = results["decode_bytes"], results["ceilings"], results["bandwidth_gbs"]
    roof_ms, busy = results["roofline_ms"], results.get("cpu_busy_before")
    bws = [c[0] for c in ceilings]
    head = [f"## Real-size bf16 on this CPU: {results['config']} config ({config_line(cfg)})\n",
            f"random weights (std {STD}, audio {AUDIO_STD}; layers outside {results['draft_layers']} damped "
            f"x{results['damp']}); {results['tokens']} new tokens; {results['cpus']} CPUs, torch {results['torch']} "
            f"({results.get('threads', '?')} threads; tp2 ranks 1 thread each)",
            f"bandwidth (2 GiB fp32 sum; best of {len(ceilings)} measurements, one before each row): "
            f"{bw:.1f} GB/s; a decode step reads "
            f"{nbytes['decoder'] / 1e9:.2f} GB decoder + {nbytes['lm_head'] / 1e9:.2f} GB LM head -> roofline "
            f"{roof_ms:.0f} ms/token; bf16 GEMM {cfg.text.intermediate_size}x{cfg.text.hidden_size} @ 16 "
            f"columns: {results['bf16_gemm_gbs']:.1f} GB/s of weights",
            f"code: {results['code']}; checkpoint: {results['checkpoint']}"
            + ("" if busy is None else f"; other processes' CPU before the run: {100 * busy:.0f}%")]
    if min(bws) < 0.8 * max(bws):
        head.append(f"NOTE: the bandwidth measurements ranged {min(bws):.0f}-{max(bws):.0f} GB/s over the run "
                    f"(see 'other procs' CPU'; with the CPUs idle too on this VM): timings taken in different "
                    f"processes (rows) vary with it; 'analytical' (tau x decode / (verify + draft), from one "
                    f"process's per-call costs) is the steadier speculation figure")
    out = [report(float(seconds), run["prompt_tokens"], run["chunks"], run["rows"], roof_ms)
           for seconds, run in results["runs"].items()]
    tail = f"\n\nbenchmark wall time {results['wall_s']:.0f} s" if "wall_s" in results else ""
    return "\n".join(head) + "\n\n" + "\n\n".join(out) + tail


def code_state() -> str:
    """Which package code ran: NXDI_VOXTRAL_BENCH_CODE when set (e.g. for a source snapshot), else git HEAD and the
    package files with uncommitted changes."""
    import subprocess
    from benchmarks.common import REPO_ROOT
    if os.environ.get("NXDI_VOXTRAL_BENCH_CODE"):
        return os.environ["NXDI_VOXTRAL_BENCH_CODE"]
    git = lambda *a: subprocess.run(["git", *a], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)  # noqa: E731
    try:
        head = git("rev-parse", "--short", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    if head.returncode:
        return "unknown (not a git checkout)"
    dirty = [line[3:] for line in git("status", "--porcelain", "--", "nxdi_voxtral").stdout.splitlines()]
    return f"git {head.stdout.strip()}" + (f", uncommitted: {', '.join(dirty)}" if dirty else ", package clean")


def config_line(cfg) -> str:
    t, a = cfg.text, cfg.audio
    return (f"decoder {t.num_layers} x {t.hidden_size}, FFN {t.intermediate_size}, {t.num_heads}/{t.num_kv_heads} "
            f"heads x {t.head_dim}, vocab {t.vocab_size}; audio {a.num_layers} x {a.hidden_size}")


def report(seconds: float, prompt_tokens: int, chunks: int, res: dict, roof_ms: float) -> str:
    ok = {k: r for k, r in res.items() if "error" not in r}
    greedy, hf = ok.get("greedy tp1"), ok.get("transformers")
    rows, mem, costs = [], [], []
    for label, r in res.items():
        if "error" in r:
            rows.append([label] + ["FAILED"] + ["-"] * 11)
            continue
        ms = r["decode_ms_per_token"]
        peak = max(m.get("VmHWM", 0) for m in r["mem_at_end"])
        ratio = max(a.get("VmHWM", 0) * 2**30 / w for a, w in zip(r["mem_at_load"], r["weight_bytes"]))
        c = r.get("costs", {})
        rows.append([label, r["load_s"], r["prefill_s"], ms, ms / roof_ms, ms / hf["decode_ms_per_token"] if hf else "-",
                     f"{r['tau']:.2f}" if r.get("tau") is not None else "-",
                     greedy["decode_ms_per_token"] / ms if greedy and r.get("k") else "-",
                     r["tau"] * c["decode"] / (c["verify"] + c["draft"]) if "verify" in c else "-",
                     c["verify"] / c["decode"] if "verify" in c else "-",
                     c["draft"] / c["decode"] if "draft" in c else "-",
                     peak, ratio,
                     pct(r.get("other_cpu"))])
        for rank, (w, a, e) in enumerate(zip(r["weight_bytes"], r["mem_at_load"], r["mem_at_end"])):
            mem.append([label, rank if len(r["weight_bytes"]) > 1 else "-", w / 2**30, a.get("VmHWM", 0),
                        a.get("VmHWM", 0) * 2**30 / w, a.get("RssAnon", 0), a.get("RssFile", 0), e.get("VmHWM", 0)])
        if c:
            costs.append([label, c["decode"], c.get("verify", "-"), c.get("draft", "-")])
    out = [f"### {seconds:g} s of audio ({chunks} chunk{'s' if chunks > 1 else ''}, {prompt_tokens} prompt tokens)\n",
           markdown_table(["configuration", "load s", "prefill s", "decode ms/tok", "x roofline", "x transformers",
                           "tau", "speed-up vs greedy", "analytical", "verify/dec", "draft K/dec", "peak RSS GiB",
                           "load peak/weights", "other procs' CPU"], rows)]
    noisy = [label for label, r in ok.items() if (r.get("other_cpu") or 0) > NOISY]
    if noisy:
        out.append(f"\nWARNING: other processes used > 10% of the CPUs during {', '.join(noisy)}: those timings are "
                   "inflated (2 OpenMP threads on 2 shared cores); rerun them on an idle machine (--only, --wait-idle)")
    if greedy:
        same = []
        for label, r in ok.items():
            if label != "greedy tp1":
                same.append(f"{label}: {same_tokens(greedy['tokens'], r['tokens'])}")
        n, dist = len(greedy["tokens"]), len(set(greedy["tokens"]))
        out.append(f"\ngreedy tp1: {n} tokens ({dist} distinct). Tokens equal greedy tp1 -- " + "; ".join(same))
    if costs:
        out.append("\nper-call ms (median of single graph calls):\n")
        out.append(markdown_table(["configuration", "decode step", "verify K+1 rows", "draft K steps (fused)"], costs))
    out.append("\nmemory per process / rank (GiB; 'anon' / 'file' = RssAnon / RssFile right after load: "
               "file = mmap'd safetensors pages):\n")
    out.append(markdown_table(["configuration", "rank", "weights held", "peak RSS after load", "ratio",
                               "anon after load", "file after load", "peak RSS at end"], mem))
    for label, r in ok.items():
        if r.get("tp", 1) > 1 and r.get("host_mem"):
            out.append(f"{label}: host process peak RSS {r['host_mem'].get('VmHWM', 0):.2f} GiB")
        if r.get("draft_shared") is not None and r.get("k"):
            out.append(f"{label}: the draft shares {', '.join(r['draft_shared']) or 'nothing'} with the target "
                       f"(engine.draft_shared)")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=["real", "mid"], default="real")
    ap.add_argument("--seconds", type=float, nargs="+", default=[30.0], help="audio lengths (default 30)")
    ap.add_argument("--long", action="store_true", help="also 120 s of audio (4 chunks)")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per generate (default 32)")
    ap.add_argument("-k", "--k", type=int, nargs="+", default=[2, 4], help="speculation depths (default 2 4)")
    ap.add_argument("--only", help="comma list of rows: greedy, transformers, spec, spec2, spec4, tp2")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-tp2", action="store_true")
    ap.add_argument("--cost-calls", type=int, default=None, help="calls per per-call cost (default 3 real, 8 mid)")
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                    help="before each row wait up to S seconds for other processes to leave the CPUs idle")
    ap.add_argument("--retry-noisy", type=int, default=0, metavar="N",
                    help="run a row again (up to N times) when other processes used > 10%% of the CPUs during it")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--damp", type=float, default=DAMP, help="o_proj/down_proj scale of the layers the draft drops")
    ap.add_argument("--json", help="write the results (and the table text) to this JSON file")
    ap.add_argument("--report", metavar="JSON", help="print the tables of a saved run (--json output) and exit")
    ap.add_argument("--write-only", action="store_true", help="write (or find) the checkpoint, print its dir, exit")
    # child process
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--draft", help=argparse.SUPPRESS)
    ap.add_argument("--inputs", help=argparse.SUPPRESS)
    ap.add_argument("--child-k", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cost_calls is None:
        args.cost_calls = 3 if args.config == "real" else 8
    if args.child:
        args.k = args.child_k
        child(args)
        return
    if args.report:
        print(render(json.loads(Path(args.report).read_text())))
        return
    if args.long and 120.0 not in args.seconds:
        args.seconds = [*args.seconds, 120.0]
    parent(args)


if __name__ == "__main__":
    main()
