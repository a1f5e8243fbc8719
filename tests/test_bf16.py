"""Exact speculative decoding in bf16: every row of a K+1-row verify pass has the bits of the 1-row decode step at
its position, so speculation == plain greedy token for token, also on fixtures full of near-ties (an LM head
scaled down: a small logit temperature) and at tp 2. Against transformers in bf16, where tokens differ, the
first difference is a near-tie (nxdi_voxtral.eval.divergence)."""
from dataclasses import replace

import pytest
import torch

from nxdi_voxtral import NxDVoxtralSpecDec, cpu_kernels
from nxdi_voxtral.eval.divergence import (Divergence, bf16_ulp, first_divergence, hf_greedy, ours_logits,
                                          report)
from nxdi_voxtral.model import attention, cached_visible
from nxdi_voxtral.tp import linear

from conftest import SMALL_BUCKETS, make_cfg, noise

N_NEW = 200
HEAD_SCALE = 0.05     # logits ~20x smaller than the random init gives: ~1 in 12 steps has a top-2 gap <= 1 bf16 ulp
AUDIO = [(5.0, "1 chunk"), (35.0, "2 chunks")]
# (decoder shape, seed): decoders with 4 layers, layers 1 and 3 damped so the draft keeping [0, 2] is accepted
NEAR_TIE = {"mha": ("mha_hd16", 3), "gqa8": ("gqa8_hd8", 5)}


def write_near_tie(root, shape: str, seed: int) -> dict:
    from nxdi_voxtral.synthetic import (damp_dropped_layers, random_state_dict, write_checkpoint,
                                        write_layer_draft, write_random_dflash)
    cfg = make_cfg(shape)
    cfg = replace(cfg, text=replace(cfg.text, num_layers=4))
    sd = damp_dropped_layers(random_state_dict(cfg, seed), [0, 2], 0.05)
    sd["language_model.lm_head.weight"] = sd["language_model.lm_head.weight"] * HEAD_SCALE
    # EOS's logit is 0, below the max of the others: every run is N_NEW tokens long on any kernel's rounding
    sd["language_model.lm_head.weight"][cfg.text.eos_token_id] = 0
    target = write_checkpoint(root / "target", cfg, sd)
    return {"target": target, "layers": write_layer_draft(target, root / "layers", [0, 2]),
            "dflash": write_random_dflash(root / "dflash", cfg, target_layer_ids=(0, 2), num_layers=1, seed=seed)}


@pytest.fixture(scope="module")
def near_tie(tmp_path_factory):
    """name -> (dirs, {seconds: (prompt, plain bf16 greedy)}); checks the fixture really is full of near-ties."""
    out = {}
    for name, (shape, seed) in NEAR_TIE.items():
        dirs = write_near_tie(tmp_path_factory.mktemp(f"bf16_{name}"), shape, seed)
        plain = NxDVoxtralSpecDec.from_pretrained(dirs["target"], dtype=torch.bfloat16, buckets=SMALL_BUCKETS)
        refs = {}
        for seconds, _ in AUDIO:
            p = plain.prepare(noise(seconds, seed=seed), sampling_rate=16000)
            ids = plain.generate(p.input_ids, p.input_features, max_new_tokens=N_NEW)[0].tolist()
            assert len(ids) == N_NEW and len(set(ids)) > N_NEW // 2, f"degenerate fixture {name}: {ids[:20]}"
            top = ours_logits(plain, p, ids).topk(2).values
            ulps = [float(a - b) / bf16_ulp(float(a)) for a, b in top.tolist()]
            assert sum(u <= 1 for u in ulps) >= 5, f"fixture {name} has too few near-ties"
            refs[seconds] = (p, ids)
        out[name] = (dirs, refs)
    return out


# ---------------------------------------------------------------- the property itself, per row

def rows_vs_steps(lm, head, tokens, start, kv_len):
    """Final logits of tokens at positions start.. computed as one K+1-row pass and as 1-row decode steps."""
    pos = torch.arange(start, start + len(tokens), dtype=torch.int32)[None]
    ids, slot = torch.tensor([tokens]), torch.zeros(1, dtype=torch.int32)
    before = lambda p: (torch.arange(kv_len) < p).int()[None]  # noqa: E731
    with torch.no_grad():
        h, _ = lm(lm.embed_tokens(ids), pos, slot, kv_len, cached_visible(pos, before(start)))
        many = head(h[0])
        one = [head(lm(lm.embed_tokens(ids[:, j:j + 1]), pos[:, j:j + 1], slot, kv_len,
                       cached_visible(pos[:, j:j + 1], before(start + j)))[0][0]) for j in range(len(tokens))]
    return many, torch.cat(one)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", ["gqa2_hd32", "mha_hd16", "gqa8_hd8"])
def test_verify_rows_equal_decode_steps(ckpt_factory, shape, dtype):
    m = NxDVoxtralSpecDec.from_pretrained(ckpt_factory(shape, seed=len(shape)), dtype=dtype, buckets=SMALL_BUCKETS)
    lm = m.model.language_model
    g = torch.Generator().manual_seed(0)
    for k1 in (2, 5, 16):
        tokens = torch.randint(1000, m.cfg.text.vocab_size, (k1,), generator=g).tolist()
        many, one = rows_vs_steps(lm, m.model.lm_head, tokens, 300 + k1, 1024)
        assert torch.equal(many, one), (k1, (many - one).abs().max())


@pytest.mark.parametrize("kernels", ["native", "torch_twins"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kernels_row_invariant_at_real_widths(dtype, kernels, monkeypatch):
    """linear and attention alone, at the benchmark model's widths (BLAS picks kernels by shape), on our C kernels
    and on the torch twins that serve where those can't be built."""
    if kernels == "torch_twins":
        monkeypatch.setattr(cpu_kernels, "kernel_library", lambda: None)
    g = torch.Generator().manual_seed(1)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    for n_in, n_out in [(1024, 2816), (2816, 1024), (1000, 48)]:
        w, x = rnd(n_out, n_in) * 0.05, rnd(16, n_in)
        for rows in (2, 3, 5, 16):
            y = linear(x[:rows], w)
            assert all(torch.equal(y[j], linear(x[j:j + 1], w)[0]) for j in range(rows)), (n_in, n_out, rows)
    hq, hkv, d, s = 16, 4, 64, 512
    q, k, v = rnd(1, hq, 16, d), rnd(1, hkv, s, d), rnd(1, hkv, s, d)
    visible = torch.arange(s)[None, :] <= torch.arange(300, 316)[:, None]
    for t in (2, 5, 16):
        out = attention(q[:, :, :t], k, v, visible[None, :t])
        for j in range(t):
            assert torch.equal(out[0, j], attention(q[:, :, j:j + 1].contiguous(), k, v, visible[None, j:j + 1])[0, 0])


# ---------------------------------------------------------------- speculative == plain greedy, bf16

SPEC_CASES = [("mha", "layers", 1), ("mha", "layers", 4), ("mha", "layers", 15), ("mha", "dflash", 15),
              ("mha", "ngram", 4), ("gqa8", "layers", 4), ("gqa8", "layers", 15), ("gqa8", "dflash", 15),
              ("gqa8", "ngram", 1), ("gqa8", "ngram", 15)]


@pytest.mark.parametrize("fixture,kind,k", SPEC_CASES)
def test_bf16_speculative_equals_greedy(near_tie, fixture, kind, k):
    dirs, refs = near_tie[fixture]
    m = NxDVoxtralSpecDec.from_pretrained(dirs["target"], draft=dirs.get(kind), draft_kind=kind,
                                          num_speculative_tokens=k, dtype=torch.bfloat16, buckets=SMALL_BUCKETS)
    # the random DFlash draft accepts nothing: each of its steps is a full 16-row verify, so one audio length
    # (1 chunk) keeps its cases inside CI's time; the layer and n-gram cases cover 2 chunks
    for seconds, label in AUDIO[:1] if kind == "dflash" else AUDIO:
        p, ref = refs[seconds]
        ids, stats = m.generate(p.input_ids, p.input_features, max_new_tokens=N_NEW, return_stats=True)
        ids = ids[0].tolist()
        assert ids == ref, f"{kind} K={k} {label}: {report(ref, ids, None)}"
        if kind == "layers" and k > 1:
            assert stats.tau > 2.5, "the layer draft should be accepted often (rows > 0 of verify emit tokens)"


def test_bf16_speculative_equals_greedy_tp2(near_tie):
    dirs, refs = near_tie["mha"]
    p, _ = refs[5.0]
    out = {}
    for kind, k in [(None, None), ("layers", 4), ("dflash", 15)]:
        with NxDVoxtralSpecDec.from_pretrained(dirs["target"], draft=dirs.get(kind), draft_kind=kind,
                                               num_speculative_tokens=k, dtype=torch.bfloat16,
                                               buckets=SMALL_BUCKETS, tp_degree=2) as m:
            out[kind] = m.generate(p.input_ids, p.input_features, max_new_tokens=N_NEW)[0].tolist()
    assert len(out[None]) == N_NEW
    assert out["layers"] == out[None], report(out[None], out["layers"], None)
    assert out["dflash"] == out[None], report(out[None], out["dflash"], None)


# ---------------------------------------------------------------- divergence report

def test_divergence_report():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 7]) == 2  # one stream ended early
    for x in (1.0, 3.7, -0.02, 250.0):
        b = torch.tensor(x, dtype=torch.bfloat16)
        assert bf16_ulp(x) == float(torch.nextafter(b.abs(), torch.tensor(float("inf"), dtype=torch.bfloat16))
                                    - b.abs())
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 2.0078125, -1.0]])
    d = report([1, 0], [1, 1], logits)
    assert (d.index, d.a, d.b) == (1, 0, 1)
    assert d.margin == pytest.approx(0.0078125) and d.ulp == 2 ** -6 and d.margin_ulps == pytest.approx(0.5)
    assert d.near_tie(1) and not d.near_tie(0.25)
    assert report([1, 0], [1, 0], logits) == Divergence(None, None, None, None, None, None)


@pytest.mark.parametrize("shape,seconds", [("gqa2_hd32", 3.0), ("gqa8_hd8", 41.5)])
def test_bf16_vs_transformers_differ_only_at_near_ties(ckpt_factory, shape, seconds):
    """Ours and transformers, both bf16, same weights (normal logit scale): where the greedy streams part, the
    fp32 model's top-2 margin is within a few bf16 ulps, and smaller than the bf16-vs-fp32 logit error there."""
    from transformers import VoxtralForConditionalGeneration
    d = ckpt_factory(shape, seed=len(shape))
    ours = NxDVoxtralSpecDec.from_pretrained(d, dtype=torch.bfloat16, buckets=SMALL_BUCKETS)
    fp32 = NxDVoxtralSpecDec.from_pretrained(d, buckets=SMALL_BUCKETS)
    hf = VoxtralForConditionalGeneration.from_pretrained(d, dtype=torch.bfloat16).eval()
    p = ours.prepare(noise(seconds, seed=int(seconds)), language="en", sampling_rate=16000)
    n = 64
    a = ours.generate(p.input_ids, p.input_features, max_new_tokens=n)[0].tolist()
    b = hf_greedy(hf, p, n)
    i = first_divergence(a, b)
    if i is None:
        return
    ref = ours_logits(fp32, p, a[:i + 1])
    div = report(a, b, ref)
    assert div.near_tie(16), div
    noise_there = (ours_logits(ours, p, a[:i + 1])[i] - ref[i]).abs().max()
    assert div.margin <= 2 * noise_there, (div, float(noise_there))
