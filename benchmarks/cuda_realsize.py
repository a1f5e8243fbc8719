"""Real-size Voxtral-Mini-3B on one CUDA GPU in bf16: per-call cost of the package's graphs, eager and as CUDA
graphs, against a roofline measured in the same run, and end-to-end greedy vs layer-draft speculation.

The stand-in for a memory-bound accelerator (issues 9 and 11): on a GPU a K+1-row verify reads the same weights
as a 1-row decode step, so its cost should stay close to one decode step.

What runs: `VoxtralModel` with the real configuration (30 layers, hidden 3072, FFN 8192, 32/8 heads, vocab 131072,
untied head; audio encoder 32 x 1280) and random bf16 weights made directly on the device (nothing on disk).
Target layers the 4-layer pruned draft drops (it keeps [0, 10, 20, 29]) have o_proj/down_proj scaled by DAMP, as
synthetic.damp_dropped_layers does, so acceptance is meaningful; the draft holds its own copy of those 4 layers
and shares embeddings, final norm, LM head and audio tower with the target. The DFlash draft is random (5 layers,
block 16): it measures cost, not acceptance. Graphs come from graphs.py (`graph_plan`, `build_graph`); the host
loops are generate.decode_step / generate.speculate_step with speculative.LayerDrafter, on one sequence (batch 1,
KV slot 0).

CUDA graphs: each (tag, bucket) module is captured once with torch.cuda.CUDAGraph over static input buffers (the
KV caches are the model's own buffers, written in place during replay); a call copies its inputs into the
static buffers and replays.

Measurement is benchmarks/common.py's, as in every benchmark: roofline_probe (device-to-device copy bandwidth,
bf16 matmul rate), time_calls (CUDA events per call; alternating end-to-end runs), weight_bytes
(Engine.weight_bytes()), markdown_table. This file runs standalone (`python3 benchmarks/cuda_realsize.py`): it puts
the repository root on sys.path, which makes `benchmarks.common` importable.

    PYTHONUNBUFFERED=1 python3 benchmarks/cuda_realsize.py --out DIR          (CUDA, ~1 min on an H200)
    python benchmarks/cuda_realsize.py --tiny --device cpu                    (a seconds-long smoke test)
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
import types
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
# `import nxdi_voxtral` runs the package __init__, which imports processing.py and with it mistral_common (not on
# the GPU machine, and not needed here). Register the package as a bare namespace so only the submodules below
# are imported.
if "nxdi_voxtral" not in sys.modules:
    _pkg = types.ModuleType("nxdi_voxtral")
    _pkg.__path__ = [str(REPO_ROOT / "nxdi_voxtral")]
    sys.modules["nxdi_voxtral"] = _pkg

from benchmarks.common import (markdown_table, median, roofline_ms, roofline_probe, time_calls,  # noqa: E402
                               weight_bytes)
from nxdi_voxtral.config import AudioEncoderConfig, TextConfig, VoxtralConfig  # noqa: E402
from nxdi_voxtral.dflash import DFlashConfig, DFlashDraft  # noqa: E402
from nxdi_voxtral.eval.divergence import first_divergence  # noqa: E402
from nxdi_voxtral.generate import I32, Sequence, cache_masks, decode_step, prepare_prefill, speculate_step  # noqa: E402
from nxdi_voxtral.graphs import Buckets, GraphSetup, GraphSpec, build_graph, example_inputs, graph_plan  # noqa: E402
from nxdi_voxtral.model import VoxtralModel, cached_visible  # noqa: E402
from nxdi_voxtral.speculative import LayerDrafter, SpecStats  # noqa: E402

DAMP = 0.02
STD, AUDIO_STD = 0.3, 0.05          # synthetic.random_state_dict's defaults
SEED = 0
DFLASH_BLOCK = 16
LANG_TOKENS = [1100, 1200]          # stand-ins for `lang:en`
OUT_LINES: list[str] = []


def say(text: str = "") -> None:
    print(text, flush=True)
    OUT_LINES.append(text)


def table(headers: list[str], rows: list[list]) -> None:
    say(markdown_table(headers, rows, pad=False, big=100, big_decimals=0))
    say()


# ---------------------------------------------------------------- configuration and random models

def configs(tiny: bool):
    if tiny:
        cfg = VoxtralConfig(audio=AudioEncoderConfig(hidden_size=32, intermediate_size=128, num_layers=1, num_heads=2),
                            text=TextConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_layers=6,
                                            num_heads=4, num_kv_heads=2, head_dim=16))
        return cfg, [0, 2, 4, 5], (1, 2, 4)
    return VoxtralConfig(), [0, 10, 20, 29], (1, 8, 14, 20, 27)   # docs/design.md §1


def fill_random_(module: nn.Module, gen: torch.Generator, std: float, audio_std: float, prefix: str = "") -> None:
    """synthetic.random_state_dict's recipe, drawn in place on the module's device: norms ~ 1 + 0.1 N(0,1),
    LayerNorm biases 0.1 N(0,1), audio tower std audio_std, everything else std."""
    for name, p in module.named_parameters():
        name = prefix + name
        if "layer_norm" in name:
            p.normal_(1.0 if name.endswith("weight") else 0.0, 0.1, generator=gen)
        elif name.endswith("norm.weight"):
            p.normal_(1.0, 0.1, generator=gen)
        else:
            p.normal_(0.0, audio_std if name.startswith("audio_tower") else std, generator=gen)


def build_models(cfg: VoxtralConfig, keep: list[int], capture: tuple, max_len: int, dtype, device):
    """Target (dropped layers damped), 4-layer pruned draft (own copy of the kept layers, the rest shared),
    random DFlash draft. Built on the meta device and materialised on `device` in `dtype`: no CPU copy."""
    gen = torch.Generator(device=device).manual_seed(SEED)
    with torch.device("meta"):
        target = VoxtralModel(cfg, max_len).to(dtype)
    target.to_empty(device=device)
    fill_random_(target, gen, STD, AUDIO_STD)
    layers = target.language_model.layers
    for i in set(range(cfg.text.num_layers)) - set(keep):
        layers[i].self_attn.o_proj.weight.mul_(DAMP)
        layers[i].mlp.down_proj.weight.mul_(DAMP)
    target.init_state(device, dtype)

    draft_cfg = replace(cfg, text=replace(cfg.text, num_layers=len(keep)))
    with torch.device("meta"):
        draft = VoxtralModel(draft_cfg, max_len).to(dtype)
    lm_d, lm_t = draft.language_model, target.language_model
    lm_d.layers.to_empty(device=device)
    for new, old in enumerate(keep):
        lm_d.layers[new].load_state_dict(lm_t.layers[old].state_dict())
    lm_d.embed_tokens, lm_d.norm = lm_t.embed_tokens, lm_t.norm
    draft.lm_head, draft.audio_tower, draft.multi_modal_projector = (
        target.lm_head, target.audio_tower, target.multi_modal_projector)
    draft.init_state(device, dtype)

    t = cfg.text
    dcfg = DFlashConfig(block_size=DFLASH_BLOCK, target_layer_ids=capture, mask_token_id=20,
                        num_target_layers=t.num_layers, text=replace(t, num_layers=5))
    with torch.device("meta"):
        dflash = DFlashDraft(dcfg, max_len).to(dtype)
    dflash.to_empty(device=device)
    fill_random_(dflash, gen, STD, AUDIO_STD)
    dflash.init_state(device, dtype)
    for m in (target, draft, dflash):
        assert all(p.device.type == torch.device(device).type for p in m.parameters()), "a parameter stayed on meta"
    return target, draft, dflash


# ---------------------------------------------------------------- one graph, eager or CUDA graph

class Runner:
    """One (tag, bucket) module: eager calls, and a CUDA graph captured over static input buffers.

    Some graphs make tensors without `device=` (arange / full / ones inside the graph); on CUDA those are CPU
    tensors and the call fails. Such a graph runs under `torch.device(device)` as default device (recorded in
    `needs_default_device`; in eager mode that context adds Python overhead per op, a CUDA graph replays without it)."""

    def __init__(self, name: str, module: nn.Module, device: str):
        self.name, self.module, self.device = name, module, device
        self.needs_default_device = False
        self.graph = None
        self.static_in = self.static_out = None
        self.capture_error = None

    def _call(self, inputs):
        if self.needs_default_device:
            with torch.device(self.device):
                return self.module(*inputs)
        return self.module(*inputs)

    def probe(self, inputs) -> None:
        inputs = [x.to(self.device) for x in inputs]
        try:
            self._call(inputs)
        except RuntimeError as e:
            if self.device == "cpu":
                raise
            print(f"  {self.name}: {str(e).splitlines()[0][:160]} -> retrying with {self.device} as default device",
                  flush=True)
            self.needs_default_device = True
            self._call(inputs)

    def eager(self, *inputs):
        return self._call([x.to(self.device) for x in inputs])

    def capture(self, inputs) -> None:
        self.static_in = [x.to(self.device).clone() for x in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._call(self.static_in)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.static_out = self._call(self.static_in)
        torch.cuda.synchronize()
        self.graph = graph

    def replay(self, *inputs):
        for buf, x in zip(self.static_in, inputs):
            buf.copy_(x, non_blocking=True)
        self.graph.replay()
        return self.static_out


# ---------------------------------------------------------------- ceilings measured in this run

def measure_ceilings(device: str, tiny: bool) -> tuple[float, float]:
    """(copy bandwidth GB/s counting bytes read + written, bf16 matmul TFLOP/s on random data): common.roofline_probe
    over a 1 GiB (tiny: 16 MiB) fp32 tensor and an 8192^2 (tiny: 512^2) matmul, best of 10 alternating rounds."""
    c = roofline_probe(device, read_gib=(16 if tiny else 1024) / 1024, methods=("copy",),
                       matmul_n=512 if tiny else 8192, matmul_dtypes=("bf16",), rounds=10)
    return c["bandwidth_gbps"], c["peak_gflops"]["bf16"] / 1e3


# ---------------------------------------------------------------- analytical bytes and FLOPs per call

def linear_params(module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


class Costs:
    """Bytes every call must read (weights once + the KV bucket) and FLOPs it must do; roofline = the larger of
    bytes / bandwidth and FLOPs / matmul rate."""

    def __init__(self, cfg, target, draft, dflash, dtype):
        self.cfg, t, self.el = cfg, cfg.text, torch.tensor([], dtype=dtype).element_size()
        self.head_bytes = weight_bytes(target.lm_head)
        self.head_flops = 2 * t.vocab_size * t.hidden_size
        self.layers_bytes = weight_bytes(target.language_model.layers, target.language_model.norm)
        self.layers_lin = linear_params(target.language_model.layers)
        self.draft_layers_bytes = weight_bytes(draft.language_model.layers, draft.language_model.norm)
        self.draft_layers_lin = linear_params(draft.language_model.layers)
        self.dflash_bytes = weight_bytes(dflash)
        self.dflash_layers_lin = linear_params(dflash.layers)
        self.dflash_fc = dflash.fc.weight.numel()
        self.dflash_kv_lin = sum(l.self_attn.k_proj.weight.numel() + l.self_attn.v_proj.weight.numel()
                                 for l in dflash.layers)
        self.audio_bytes = weight_bytes(target.audio_tower, target.multi_modal_projector)
        self.audio_lin = linear_params(target.audio_tower.layers)
        self.proj_lin = linear_params(target.multi_modal_projector)

    def kv_bytes(self, n_layers: int, s: int) -> int:
        t = self.cfg.text
        return 2 * n_layers * t.num_kv_heads * s * t.head_dim * self.el

    def attn_flops(self, n_layers: int, rows: int, keys: int) -> int:
        t = self.cfg.text
        return 4 * n_layers * rows * keys * t.num_heads * t.head_dim

    def __call__(self, tag: str, s: int, rows: int, k: int = 0, prompt: int = 0) -> tuple[int, int]:
        t, a, h = self.cfg.text, self.cfg.audio, self.cfg.text.hidden_size
        n, nd = t.num_layers, 4
        if tag in ("token_generation", "verify"):
            return (self.layers_bytes + self.head_bytes + self.kv_bytes(n, s) + rows * h * self.el,
                    2 * rows * self.layers_lin + self.attn_flops(n, rows, s) + rows * self.head_flops)
        if tag == "draft_fused_k":   # K unrolled steps, each reads the draft layers, the head and the KV bucket
            step_bytes = self.draft_layers_bytes + self.head_bytes + self.kv_bytes(nd, s)
            step_rows = [2] + [1] * (k - 1)
            return (k * step_bytes, sum(2 * r * self.draft_layers_lin + self.attn_flops(nd, r, s) + self.head_flops
                                        for r in step_rows))
        if tag == "dflash_draft":    # context K/V of 16 new rows, then the 16-row block pass, head on K rows
            b = DFLASH_BLOCK
            return (self.dflash_bytes + self.head_bytes + self.kv_bytes(5, s),
                    2 * b * (self.dflash_fc + self.dflash_kv_lin + self.dflash_layers_lin)
                    + self.attn_flops(5, b, s + b) + k * self.head_flops)
        if tag == "audio_encoder":
            frames, d = a.max_source_positions, a.hidden_size
            conv = 2 * 2 * frames * a.num_mel_bins * 3 * d + 2 * frames * d * 3 * d
            attn = 4 * a.num_layers * frames * frames * d
            return (self.audio_bytes,
                    conv + 2 * frames * self.audio_lin + attn + 2 * a.tokens_per_chunk * self.proj_lin)
        if tag == "context_encoding":
            return (self.layers_bytes + self.head_bytes + self.kv_bytes(n, prompt),
                    2 * prompt * self.layers_lin + self.attn_flops(n, prompt, prompt) + self.head_flops)
        raise ValueError(tag)


# ---------------------------------------------------------------- inputs with realistic values

def prompt_inputs(cfg, buckets, device, gen):
    """A 30 s transcription prompt: [BOS][INST][BEGIN_AUDIO] [AUDIO]x375 [/INST] lang [TRANSCRIBE], random mel."""
    n_audio = cfg.audio.tokens_per_chunk
    ids = torch.tensor([[1, 3, 25] + [cfg.audio_token_id] * n_audio + [4] + LANG_TOKENS + [34]])
    mel = torch.randn(1, cfg.audio.num_mel_bins, cfg.audio.mel_frames_per_chunk, generator=gen)
    return prepare_prefill(ids, mel, cfg, buckets)


def call_inputs(spec: GraphSpec, setup: GraphSetup, position: int, dtype, gen) -> tuple:
    """Inputs of the declared shapes (example_inputs) filled with plausible, non-zero values at `position`."""
    shapes = example_inputs(spec, setup)
    s, v = spec.bucket, setup.cfg.text.vocab_size
    tok = lambda *shape: torch.randint(1000, v, shape, generator=gen, dtype=I32)  # noqa: E731
    rng = lambda start, n: (start + torch.arange(n, dtype=I32))[None]  # noqa: E731
    slot = torch.zeros(1, dtype=I32)   # one sequence, KV slot 0
    if spec.tag == "token_generation":
        out = (tok(1, 1), torch.tensor([position], dtype=I32), cache_masks(s, [position]), slot)
    elif spec.tag == "verify":
        out = (tok(1, setup.k + 1), rng(position, setup.k + 1), cache_masks(s, [position]),
               torch.tensor([setup.k], dtype=I32), slot)
    elif spec.tag == "draft_fused_k":
        out = (tok(1, 2), rng(position - 1, 2), cache_masks(s, [position - 1]), slot)
    elif spec.tag == "dflash_draft":
        r = 5   # accepted rows whose features arrive with this call; the rest is padding
        out = (torch.randn(1, setup.dflash_block, setup.feature_dim, generator=gen).to(dtype), rng(position - r,
               setup.dflash_block), tok(1, 1), torch.tensor([position], dtype=I32), cache_masks(s, [position]), slot)
    else:
        raise ValueError(spec.tag)
    assert [(x.shape, x.dtype) for x in out] == [(x.shape, x.dtype) for x in shapes], spec
    return out


def margin_at_divergence(target, runner_ce, prefill_inputs, tokens, i, bucket, dev) -> dict:
    """Plain greedy's logits for token i (where a speculative run first differs), recomputed eagerly one token at
    a time as token_generation does: top-1 vs runner-up margin against the bf16 spacing at the top-1 logit."""
    runner_ce.eager(*prefill_inputs)  # the prompt's K/V
    lm, position = target.language_model, int(prefill_inputs[3][0]) + 1
    slots = torch.zeros(1, dtype=I32, device=dev)
    for j in range(i):
        pos = torch.tensor([[position + j]], dtype=I32, device=dev)
        x = lm.embed_tokens(torch.tensor([[tokens[j]]], device=dev))
        h, _ = lm(x, pos, slots, bucket, cached_visible(pos, cache_masks(bucket, [position + j]).to(dev)))
    logits = target.lm_head(h[0, -1]).float()
    top = torch.topk(logits, 2)
    top1, top2 = float(top.values[0]), float(top.values[1])
    spacing = 2.0 ** (torch.floor(torch.log2(torch.tensor(abs(top1)))).item() - 7)   # bf16: 8 significant bits
    return dict(token=i, top1=top1, margin=top1 - top2, bf16_spacing=spacing,
                plain_token=int(top.indices[0]), runner_up=int(top.indices[1]))


# ---------------------------------------------------------------- the benchmark

@torch.inference_mode()   # static buffers and KV caches are inference tensors; all in-place writes happen in here
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="a tiny config (smoke test)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="directory for cuda_realsize.md")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--reps", type=int, default=5, help="end-to-end runs per configuration (CUDA graphs)")
    args = ap.parse_args()
    dev, dtype = args.device, getattr(torch, args.dtype)
    use_graphs = dev.startswith("cuda")
    reps_call, reps_e2e = (20, args.reps) if not args.tiny else (3, 1)
    t_start = time.perf_counter()

    cfg, keep, capture = configs(args.tiny)
    buckets = Buckets(audio_chunks=(1,), kv_lengths=(1024, 4096))
    buckets.validate(cfg)
    if use_graphs:
        name = torch.cuda.get_device_name()
        say(f"device: {name}; torch {torch.__version__}; CUDA {torch.version.cuda}; {args.dtype}")
    else:
        say(f"device: {dev}; torch {torch.__version__}; {args.dtype}")
    bw, tflops = measure_ceilings(dev, args.tiny)
    say(f"measured ceilings: device-to-device copy {bw:.0f} GB/s (read + write), bf16 matmul {tflops:.0f} TFLOP/s")

    t0 = time.perf_counter()
    target, draft, dflash = build_models(cfg, keep, capture, buckets.kv_lengths[-1], dtype, dev)
    if use_graphs:
        torch.cuda.synchronize()
    costs = Costs(cfg, target, draft, dflash, dtype)
    gb = lambda b: b / 2 ** 30  # noqa: E731
    say(f"models built on {dev} in {time.perf_counter() - t0:.1f} s: target weights "
        f"{gb(weight_bytes(target)):.2f} GiB, "
        f"pruned draft's own layers {gb(costs.draft_layers_bytes):.2f} GiB (keeps target layers {keep}; dropped layers "
        f"damped x{DAMP}), DFlash draft {gb(costs.dflash_bytes):.2f} GiB (5 layers, block {DFLASH_BLOCK}); "
        f"a decode step reads {costs.layers_bytes / 1e9:.2f} GB of decoder + {costs.head_bytes / 1e9:.2f} GB of LM head")

    # every graph the benchmark uses, from the package's own plan
    layer_setups = {k: GraphSetup(cfg, buckets, dtype, "layers", k) for k in (2, 4)}
    dflash_setup = GraphSetup(cfg, buckets, dtype, "dflash", DFLASH_BLOCK - 1, capture_layers=capture,
                              dflash_block=DFLASH_BLOCK)
    runners: dict = {}   # (name, bucket) -> Runner; name = tag or tag/K
    for label, setup, drafter_model in [("k2", layer_setups[2], draft), ("k4", layer_setups[4], draft),
                                        ("dflash", dflash_setup, dflash)]:
        for spec in graph_plan(setup):
            if spec.tag in ("dflash_context",):
                continue
            name = spec.tag if spec.tag in ("audio_encoder", "context_encoding", "token_generation",
                                            "draft_context_encoding") else f"{spec.tag}/{label}"
            if (name, spec.bucket) not in runners:
                runners[(name, spec.bucket)] = (spec, setup, Runner(name, build_graph(spec, setup, target,
                                                                                      drafter_model), dev))
    gen = torch.Generator().manual_seed(SEED)
    nb, mel, ids, audio_positions, last_index = prompt_inputs(cfg, buckets, dev, gen)
    prompt_len = ids.shape[1]
    audio_embeds = torch.randn(audio_positions.shape[0], cfg.text.hidden_size, generator=gen).to(dtype)
    slot0 = torch.zeros(1, dtype=I32)   # the one sequence's KV slot (batch 1)

    def inputs_for(spec, setup, position):
        """Prefill graphs: inputs already on the device (in the host loop the audio embeddings come from the
        audio encoder's output there). Decode-side graphs: small host tensors, as the host loops pass them."""
        on_dev = lambda *xs: tuple(x.to(dev) for x in xs)  # noqa: E731
        if spec.tag == "audio_encoder":
            return on_dev(mel)
        if spec.tag == "context_encoding":
            return on_dev(ids, audio_embeds, audio_positions, last_index, slot0)
        if spec.tag == "draft_context_encoding":
            return on_dev(ids, audio_embeds, audio_positions, slot0)
        return call_inputs(spec, setup, position, dtype, gen)

    # ---------------- per-call cost
    t0 = time.perf_counter()
    rows, graph_ms = [], {}
    order = ["audio_encoder", "context_encoding", "draft_context_encoding", "token_generation", "verify/k2",
             "verify/k4", "verify/dflash", "draft_fused_k/k2", "draft_fused_k/k4", "dflash_draft/dflash"]
    for name in order:
        for (n, bucket), (spec, setup, runner) in runners.items():
            if n != name:
                continue
            position = bucket // 2
            inputs = inputs_for(spec, setup, position)
            rows_in = {"verify": setup.k + 1, "draft_fused_k": 2, "dflash_draft": DFLASH_BLOCK,
                       "token_generation": 1,
                       "audio_encoder": cfg.audio.max_source_positions}.get(spec.tag, prompt_len)
            try:
                runner.probe(inputs)
                eager = 1e3 * time_calls(lambda: runner.eager(*inputs), reps_call, warmup=2, reduce=median, device=dev)
                graph = "-"   # per-call times: each call alone (the host loops read every result before the next)
                if use_graphs:
                    try:
                        runner.capture(inputs)
                        graph = 1e3 * time_calls(lambda: runner.replay(*inputs), max(reps_call, 50), warmup=3,
                                                reduce=median, device=dev)
                        graph_ms[(name, bucket)] = graph
                    except Exception as e:  # noqa: BLE001 - record and go on: one failed capture must not end the run
                        runner.capture_error = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                        traceback.print_exc()
                        graph = "capture failed"
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                rows.append([name, bucket, rows_in, f"failed: {type(e).__name__}", "-", "-", "-", "-", "-", "-"])
                continue
            if spec.tag == "draft_context_encoding":
                nbytes, flops = (costs.draft_layers_bytes + costs.kv_bytes(4, prompt_len),
                                 2 * prompt_len * costs.draft_layers_lin + costs.attn_flops(4, prompt_len, prompt_len))
            else:
                nbytes, flops = costs(spec.tag, bucket, rows_in, setup.k, prompt_len)
            roof = roofline_ms(nbytes, bw, flops, tflops * 1e3)
            best = graph if isinstance(graph, float) else eager
            tag = name.split("/")[0] + (f" K={setup.k}" if spec.tag in ("verify", "draft_fused_k") else "")
            if runner.needs_default_device:
                tag += " *"
            bucket_label = bucket if spec.tag not in ("audio_encoder", "context_encoding",
                                                      "draft_context_encoding") else f"{bucket} chunk"
            rows.append([tag, bucket_label, rows_in, eager, graph, nbytes / 1e6, flops / 1e9, roof, roof / best,
                         "-"])
            say(f"  {tag:<28} {bucket_label!s:>8}  eager {eager:8.3f} ms  graph {graph if isinstance(graph, str) else f'{graph:8.3f}'} ms"
                f"  roofline {roof:7.3f} ms")
    # "x decode": graph time over the token_generation graph at the same KV bucket
    for r in rows:
        base = graph_ms.get(("token_generation", r[1])) if isinstance(r[1], int) else None
        if base and isinstance(r[4], float):
            r[9] = r[4] / base
        elif not use_graphs and isinstance(r[1], int) and isinstance(r[3], float):
            base_rows = [x for x in rows if x[0] == "token_generation" and x[1] == r[1]]
            r[9] = r[3] / base_rows[0][3] if base_rows else "-"
    say()
    say(f"### Per-call cost ({'CUDA events' if use_graphs else 'wall clock'}, median of {reps_call} calls after "
        f"warm-up; {time.perf_counter() - t0:.0f} s)")
    say()
    table(["graph", "KV bucket", "rows", "eager ms", "CUDA graph ms", "MB read", "GFLOP", "roofline ms",
           "roofline / best", "x decode (graph)"], rows)
    needing = sorted({r.name for _, _, r in runners.values() if r.needs_default_device})
    if needing:
        say(f"\\* ran under `torch.device('{dev}')` as default device: {', '.join(needing)} create tensors without "
            f"`device=` inside the graph (docs/design.md §2 asks for `device=` from an input).")
    failed = [f"{r.name}: {r.capture_error}" for _, _, r in runners.values() if r.capture_error]
    if failed:
        say("CUDA graph capture failed for: " + "; ".join(failed))
    say("roofline = max(bytes / measured copy bandwidth, FLOPs / measured matmul rate); bytes = weights read once "
        "per call (the fused-K draft reads its layers and the LM head once per step) + the K/V of the whole bucket.")
    say()

    # ---------------- end to end: the package's host loops over the graphs
    t0 = time.perf_counter()
    n_new = args.new_tokens if not args.tiny else 24
    eos = -1   # EOS ignored: every run emits exactly n_new tokens (random weights may emit id 2 at any point)

    def run_fn(mode: str, k: int | None):
        def run(tag, bucket, *inputs):
            name = tag if tag in ("audio_encoder", "context_encoding", "token_generation",
                                  "draft_context_encoding") else f"{tag}/k{k}"
            runner = runners[(name, bucket)][2]
            if mode == "graph" and runner.graph is not None:
                return runner.replay(*inputs)
            return runner.eager(*inputs)
        return run

    def one_run(mode: str, k: int | None):
        run = run_fn(mode, k)
        stats = SpecStats("layers" if k else "none", k or 0)
        sync = torch.cuda.synchronize if use_graphs else (lambda: None)
        sync()
        t_a = time.perf_counter()
        (embeds,) = run("audio_encoder", nb, mel)
        first, *_ = run("context_encoding", nb, ids, embeds, audio_positions, last_index, slot0)
        position = int(last_index[0]) + 1
        seq = Sequence(0, [], position, n_new, eos, stats, int(ids[0, position - 1]))
        drafter = None
        if k:
            drafter = LayerDrafter(run, buckets, k)
            drafter.prefill(seq, nb, ids, embeds, audio_positions)
        seq.emit([int(first[0])])
        sync()
        t_b = time.perf_counter()
        while not seq.done:   # batch 1: no free slots to pad with
            if k:
                speculate_step(run, drafter, [seq], buckets, k, [])
            else:
                decode_step(run, [seq], buckets, [])
        tokens = seq.tokens
        sync()
        t_c = time.perf_counter()
        return tokens, stats, 1e3 * (t_b - t_a), 1e3 * (t_c - t_b) / (len(tokens) - 1)

    def guarded(mode: str, k: int | None):
        def run():
            try:
                return one_run(mode, k)
            except Exception as e:  # noqa: BLE001 - a failed configuration must not end the run
                traceback.print_exc()
                return e
        return run

    ms_tok_of = lambda r: r[3] if isinstance(r, tuple) else float("inf")  # noqa: E731
    modes = (["graph"] if use_graphs else []) + ["eager"]
    results = {}
    for mode in modes:
        # alternate the configurations (one warm-up round), keep the fastest run of each
        outs = {}
        time_calls({k: guarded(mode, k) for k in (None, 2, 4)}, reps_e2e if mode == "graph" else min(reps_e2e, 2),
                   seconds=ms_tok_of, outputs=outs)
        results.update({(mode, k): min(runs, key=ms_tok_of) for k, runs in outs.items()})
    if use_graphs:
        torch.cuda.synchronize()
    reference = results.get((modes[0], None))
    ref_tokens = reference[0] if isinstance(reference, tuple) else None
    e2e_rows = []
    for mode in modes:
        plain = results.get((mode, None))
        for k in (None, 2, 4):
            r = results.get((mode, k))
            if not isinstance(r, tuple):
                e2e_rows.append([mode, k or "plain", f"failed: {r}"] + ["-"] * 8)
                continue
            tokens, stats, prefill_ms, ms_tok = r
            speedup = plain[3] / ms_tok if isinstance(plain, tuple) else "-"
            analytical = "-"
            if k and mode == "graph":
                c = lambda name: graph_ms.get((name, buckets.kv_lengths[0]))  # noqa: E731
                if c("token_generation") and c(f"verify/k{k}") and c(f"draft_fused_k/k{k}"):
                    analytical = stats.tau * c("token_generation") / (c(f"verify/k{k}") + c(f"draft_fused_k/k{k}"))
            passes = (stats.target_passes - 1) / (len(tokens) - 1)
            same = tokens == ref_tokens
            first_diff = "-" if same or ref_tokens is None else first_divergence(tokens, ref_tokens)
            e2e_rows.append([mode, k or "plain", stats.tau if k else "-", passes, prefill_ms, ms_tok, speedup,
                             analytical, "yes" if same else f"no (from token {first_diff})",
                             f"{len(set(tokens))}/{len(tokens)}"])
    say(f"### End to end ({n_new} tokens after a {prompt_len}-token prefill, KV bucket {buckets.kv_lengths[0]}; "
        f"fastest of {reps_e2e} alternating runs for CUDA graphs, {min(reps_e2e, 2)} for eager; "
        f"{time.perf_counter() - t0:.0f} s)")
    say()
    table(["mode", "draft K", "tau", "target passes/token", "prefill ms", "ms/token", "speed-up vs plain (same mode)",
           "analytical tau*t_dec/(t_ver+t_draft)", "tokens == plain greedy", "distinct/total"], e2e_rows)
    same = all(r[8] == "yes" for r in e2e_rows)
    say(f"every row's tokens identical to plain greedy ({modes[0]}): {'yes' if same else 'NO'}")
    say()
    if not same and ref_tokens is not None:
        first = min((first_divergence(r[0], ref_tokens), mode, k)
                    for (mode, k), r in results.items() if isinstance(r, tuple) and r[0] != ref_tokens)
        i, mode, k = first
        try:
            embeds = runners[("audio_encoder", nb)][2].eager(mel)[0]
            m = margin_at_divergence(target, runners[("context_encoding", nb)][2],
                                     (ids, embeds, audio_positions, last_index, slot0), ref_tokens, i,
                                     buckets.kv_lengths[0], dev)
            spec_token = results[(mode, k)][0][i]
            say(f"first divergence: {mode} K={k} at token {i} (plain {m['plain_token']}, speculative {spec_token}; "
                f"plain's runner-up {m['runner_up']}): plain's top-1 logit {m['top1']:.4g}, margin to the runner-up "
                f"{m['margin']:.3g}, bf16 spacing at that logit {m['bf16_spacing']:.3g} -> "
                f"{'a near-tie within bf16 rounding' if m['margin'] <= 2 * m['bf16_spacing'] else 'NOT a near-tie'}")
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        say()

    if use_graphs:
        kv = sum(b.numel() * b.element_size() for m in (target.language_model, draft.language_model, dflash)
                 for b in (m.k_cache, m.v_cache))
        say("### GPU memory")
        say()
        table(["what", "GiB"], [
            ["target weights (incl. audio tower, embeddings, LM head)", gb(weight_bytes(target))],
            ["pruned draft's own layers (the rest shared with the target)", gb(costs.draft_layers_bytes)],
            ["DFlash draft", gb(costs.dflash_bytes)],
            [f"KV caches (target, draft, DFlash; {buckets.kv_lengths[-1]} slots)", gb(kv)],
            ["peak allocated by torch (whole run, incl. CUDA graph pools)", gb(torch.cuda.max_memory_allocated())],
        ])
    say(f"total {time.perf_counter() - t_start:.0f} s")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "cuda_realsize.md").write_text("\n".join(OUT_LINES) + "\n")


if __name__ == "__main__":
    main()
