"""Every graph x bucket x draft kind (and bf16, and a layer draft with its own audio tower) lowers on torch-xla's
CPU device as exactly one graph: no CPU fallback, no execution while forward() runs, no dynamic shapes; outputs and
KV caches equal CPU eager (ints exact, floats within fp32 tolerance)."""
import os

os.environ.setdefault("NXD_LOG_LEVEL", "warning")

import copy

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met

from nxdi_voxtral.engine import build_engine
from nxdi_voxtral.graphs import build_graph, example_inputs, graph_plan, kv_caches
from nxdi_voxtral.checkpoint import read_safetensors

from nxdi_voxtral.graphs import Buckets

SMALL_BUCKETS = Buckets(audio_chunks=(1, 2), kv_lengths=(512, 1024), batch_sizes=(1, 2))

CASES = [("none", torch.float32), ("layers", torch.float32), ("layers_own_audio", torch.float32),
         ("dflash", torch.float32), ("ngram", torch.float32), ("layers", torch.bfloat16)]


@pytest.fixture(scope="module")
def own_audio_draft(spec_dirs, tmp_path_factory):
    """The layer draft with a perturbed audio tower: draft_context_encoding then runs its own encoder on mel."""
    src = spec_dirs["layers_high"]
    sd = read_safetensors(src)
    key = next(k for k in sd if "audio_tower" in k and k.endswith("fc1.weight"))
    sd[key] = sd[key] * 1.5
    out = tmp_path_factory.mktemp("own_audio")
    for f in ("config.json", "tekken.json"):
        (out / f).write_text((src / f).read_text())
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
    return out


def engine_for(case, dtype, spec_dirs, own_audio_draft):
    kind = None if case == "none" else case.split("_")[0]
    draft = {"layers": spec_dirs["layers_high"], "layers_own_audio": own_audio_draft,
             "dflash": spec_dirs["dflash"]}.get(case)
    return build_engine(spec_dirs["target"], draft=draft, draft_kind=kind, k=3 if kind == "ngram" else None,
                        dtype=dtype, buckets=SMALL_BUCKETS)


def inputs_for(spec, setup, g):
    vocab = setup.cfg.text.vocab_size
    out = []
    for i, t in enumerate(example_inputs(spec, setup)):
        if t.is_floating_point():
            out.append(torch.randn(t.shape, generator=g).to(t.dtype))
        elif i == 0 and spec.tag != "audio_encoder":  # ids / tokens / candidates
            out.append(torch.randint(0, vocab, t.shape, generator=g, dtype=t.dtype))
        elif i == len(example_inputs(spec, setup)) - 1 and spec.tag != "audio_encoder":  # slots: one per row
            out.append(torch.arange(t.shape[0], dtype=t.dtype))
        else:
            out.append(t)
    return tuple(out)


def caches_of(model, draft):
    return [c for m in (model, draft) if m is not None for c in kv_caches(m)]


@pytest.mark.parametrize("case,dtype", CASES, ids=[f"{c}-{str(d)[6:]}" for c, d in CASES])
def test_graphs_lower_as_one_xla_graph(case, dtype, spec_dirs, own_audio_draft):
    engine = engine_for(case, dtype, spec_dirs, own_audio_draft)
    assert engine.setup.draft_own_audio == (case == "layers_own_audio")
    dev = torch_xla.device()
    g = torch.Generator().manual_seed(0)
    for spec in graph_plan(engine.setup):
        for c in caches_of(engine.model, engine.draft):  # random caches: the graphs' reads of them matter
            c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))
        x_model, x_draft = copy.deepcopy((engine.model, engine.draft))  # one deepcopy keeps shared modules shared
        x_model.to(dev)
        if x_draft is not None:
            x_draft.to(dev)
        x_graph = build_graph(spec, engine.setup, x_model, x_draft)
        inputs = inputs_for(spec, engine.setup, g)
        cpu_out = engine.run(spec.tag, spec.bucket, *inputs)
        torch_xla.sync()
        met.clear_all()
        with torch.no_grad():
            xla_out = x_graph(*[t.to(dev) for t in inputs])
        name = f"{case}/{spec.name}"
        assert met.metric_data("ExecuteTime") is None, f"{name}: executed while tracing (host sync)"
        assert not met.executed_fallback_ops(), f"{name}: CPU fallback {met.executed_fallback_ops()}"
        x_caches = caches_of(x_model, x_draft)
        hlo = torch_xla._XLAC._get_xla_tensors_hlo(list(xla_out) + x_caches)
        assert "<=" not in hlo, f"{name}: dynamic shapes in the HLO"
        torch_xla.sync()
        assert met.metric_data("TensorsGraphSize")[0] == 1, f"{name}: not exactly one graph"
        cpu_caches = caches_of(engine.model, engine.draft)
        for a, b in zip(list(cpu_out) + cpu_caches, list(xla_out) + x_caches):
            b = b.cpu()
            assert a.dtype == b.dtype and a.shape == b.shape, name
            if dtype == torch.bfloat16:
                # torch's CPU kernels and XLA's round bf16 intermediates differently, so a greedy near-tie may
                # flip (and an unrolled draft then diverges): in bf16 this test checks the lowering above, and
                # that float outputs and caches agree to bf16 accuracy; the token checks are the fp32 cases'
                if a.is_floating_point() and spec.tag != "draft_fused_k":  # its later caches follow its tokens
                    assert (b.float() - a.float()).norm() <= 0.05 * a.float().norm() + 1e-3, name
            elif a.is_floating_point():
                torch.testing.assert_close(b, a, rtol=1e-3, atol=5e-4, msg=lambda m: f"{name}: {m}")
            else:
                assert torch.equal(a, b), f"{name}: int outputs differ {a.tolist()} vs {b.tolist()}"
