"""DFlash numerics: our draft's proposals equal a straightforward implementation written here from the
formulas (docs/design.md §5), fed with features from transformers' target model; and the acceptance tool."""
import json

import pytest
import torch
from safetensors.torch import load_file

from nxdi_voxtral.eval.acceptance import target_features, teacher_forced

from conftest import noise


def rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):  # x [heads, T, D]
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def reference_block(w, cfg, feats, block_emb, start, lm_head):
    """feats [start, n*H]: target layer outputs of positions 0..start-1; block_emb [B, H] at start..start+B-1."""
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    ctx = rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    b = block_emb.shape[0]
    pos_ctx, pos_blk = torch.arange(start), start + torch.arange(b)
    x = block_emb
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"], eps)
        q = rms((h @ w[p + "self_attn.q_proj.weight"].T).view(b, nh, hd), w[p + "self_attn.q_norm.weight"], eps)
        both = torch.cat([ctx, h])
        k = rms((both @ w[p + "self_attn.k_proj.weight"].T).view(-1, nkv, hd), w[p + "self_attn.k_norm.weight"], eps)
        v = (both @ w[p + "self_attn.v_proj.weight"].T).view(-1, nkv, hd)
        q = rope(q.transpose(0, 1), pos_blk, theta)
        k = rope(k.transpose(0, 1), torch.cat([pos_ctx, pos_blk]), theta)
        k, v = k.repeat_interleave(nh // nkv, 0), v.transpose(0, 1).repeat_interleave(nh // nkv, 0)
        att = torch.softmax(q @ k.transpose(-1, -2) / hd ** 0.5, -1) @ v  # no mask at all
        x = x + att.transpose(0, 1).reshape(b, -1) @ w[p + "self_attn.o_proj.weight"].T
        m = rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    out = rms(x, w["norm.weight"], eps)
    return torch.argmax(out[1:] @ lm_head.T, -1).tolist()


@pytest.fixture(scope="module")
def hf_trace(spec_dirs, spec_models):
    from transformers import VoxtralForConditionalGeneration
    m = spec_models["dflash"]
    p = m.prepare(noise(3.0, seed=4), sampling_rate=16000)
    trace = m.generate(p.input_ids, p.input_features, max_new_tokens=30)[0].tolist()
    hf = VoxtralForConditionalGeneration.from_pretrained(spec_dirs["target"]).eval()
    seq = torch.cat([p.input_ids, torch.tensor([trace])], dim=1)
    with torch.no_grad():
        hs = hf(input_ids=seq, input_features=p.input_features, output_hidden_states=True).hidden_states
    ids = m.setup.capture_layers
    feats = torch.cat([hs[i + 1][0] for i in ids], dim=-1)  # output of decoder layer i
    return p, trace, feats


def test_target_capture_features_match_transformers_hidden_states(spec_models, hf_trace):
    m = spec_models["dflash"]
    p, trace, ref = hf_trace
    seq = m.start(p.input_ids, p.input_features, 30, slot=0)
    ours = target_features(m, trace, seq.position, seq.slot)
    position = seq.position
    torch.testing.assert_close(ours, ref[position:position + len(trace)], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("new_rows", [0, 1, 3, 16])
def test_dflash_proposals_equal_reference(spec_dirs, spec_models, hf_trace, new_rows):
    """Context = prompt + `new_rows` accepted positions appended in one call (the bookkeeping after a verify)."""
    m = spec_models["dflash"]
    p, trace, feats = hf_trace
    cfg = json.loads((spec_dirs["dflash"] / "config.json").read_text())
    w = load_file(str(spec_dirs["dflash"] / "model.safetensors"))
    seq = m.start(p.input_ids, p.input_features, 30, slot=0)
    position = seq.position
    own = target_features(m, trace, position, seq.slot)
    if new_rows:
        m.drafter.accepted(seq, new_rows - 1, own[:new_rows])
    anchor_pos = position + new_rows
    seq.tokens, seq.position = trace[:new_rows + 1], anchor_pos
    (proposals,) = m.drafter.propose([seq], [])
    block_ids = torch.tensor([trace[new_rows]] + [cfg["dflash_config"]["mask_token_id"]] * 15)
    emb = m.model.language_model.embed_tokens(block_ids)
    with torch.no_grad():
        ref = reference_block(w, cfg, feats[:anchor_pos], emb, anchor_pos, m.model.lm_head.weight)
    assert proposals == ref


def test_acceptance_tool_tau(spec_dirs, spec_models):
    p = spec_models["plain"].prepare(noise(3.0, seed=6), sampling_rate=16000)
    high = teacher_forced(spec_models["layers"], p.input_ids, p.input_features, 30)
    assert high["anchors"] == 29 and high["tau"] > 2.5
    assert high["tau"] == pytest.approx(sum(a + 1 for a in high["accepted"]) / 29)
    for kind in ("dflash", "ngram"):
        r = teacher_forced(spec_models[kind], p.input_ids, p.input_features, 30)
        assert r["trace"] == high["trace"] and 1.0 <= r["tau"] <= 1 + spec_models[kind].setup.k


def test_acceptance_cli(spec_dirs, tmp_path):
    import soundfile as sf
    from nxdi_voxtral.eval.acceptance import main
    wav = tmp_path / "a.wav"
    sf.write(wav, noise(2.0), 16000)
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main([str(wav), "--model", str(spec_dirs["target"]), "--draft", str(spec_dirs["layers_high"]),
                   "--draft-kind", "layers", "-k", "3", "--max-new-tokens", "12", "--json"])
    assert rc == 0
    res = json.loads(out.getvalue())
    assert res["k"] == 3 and res["tau"] > 1
