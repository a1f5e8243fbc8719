"""Our graphs against transformers' VoxtralForConditionalGeneration on the same checkpoint files."""
import pytest
import torch

from nxdi_voxtral import NxDVoxtralSpecDec
from nxdi_voxtral.model import cached_visible, causal_visible

from conftest import SMALL_BUCKETS, noise


@pytest.fixture(scope="module")
def hf_cls():
    from transformers import VoxtralForConditionalGeneration
    return VoxtralForConditionalGeneration


def hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(input_ids=prompt.input_ids, input_features=prompt.input_features, max_new_tokens=n,
                          do_sample=False)
    return out[0, prompt.input_ids.shape[1]:].tolist()


@pytest.mark.parametrize("shape", ["gqa2_hd32", "mha_hd16", "gqa8_hd8"])
@pytest.mark.parametrize("seconds", [3.0, 41.5])
def test_greedy_tokens_and_logits_match_transformers(ckpt_factory, hf_cls, shape, seconds):
    d = ckpt_factory(shape, seed=len(shape))
    ours = NxDVoxtralSpecDec.from_pretrained(d, buckets=SMALL_BUCKETS)
    hf = hf_cls.from_pretrained(d, attn_implementation="eager").eval()
    prompt = ours.prepare(noise(seconds, seed=int(seconds)), language="en", sampling_rate=16000)
    assert prompt.input_features.shape[0] == (1 if seconds < 30 else 2)

    n = 24
    ours_ids = ours.generate(prompt.input_ids, prompt.input_features, max_new_tokens=n)[0].tolist()
    ref_ids = hf_greedy(hf, prompt, n)
    assert ours_ids == ref_ids
    assert len(set(ours_ids)) >= 8, f"degenerate fixture: {ours_ids}"

    # logits over prompt + generated tokens: prefill path (no cache read) and cached single-token path
    full = torch.cat([prompt.input_ids, torch.tensor([ours_ids[:-1]])], dim=1)
    with torch.no_grad():
        ref_logits = hf(input_ids=full, input_features=prompt.input_features).logits[0]
        m = ours.model
        audio = m.encode_audio(prompt.input_features)
        pos = (full[0] == m.cfg.audio_token_id).nonzero().flatten()
        t0 = prompt.input_ids.shape[1]
        x = m.embed_with_audio(full[:, :t0], audio, pos)
        slot = torch.zeros(1, dtype=torch.int32)
        h, _ = m.language_model(x, torch.arange(t0)[None], slot, None, causal_visible(t0, x.device))
        logits = [m.lm_head(h[0])]
        for p in range(t0, full.shape[1]):
            e = m.language_model.embed_tokens(full[:, p:p + 1])
            mask = (torch.arange(1024) < p).int()[None]
            h, _ = m.language_model(e, torch.tensor([[p]]), slot, 1024, cached_visible(torch.tensor([[p]]), mask))
            logits.append(m.lm_head(h[0]))
        logits = torch.cat(logits)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


def test_audio_embeddings_match_transformers(tiny_dir, tiny_model, hf_cls):
    hf = hf_cls.from_pretrained(tiny_dir).eval()
    prompt = tiny_model.prepare(noise(35.0, seed=3), sampling_rate=16000)
    with torch.no_grad():
        ref = hf.get_audio_features(prompt.input_features).pooler_output
        ours = tiny_model.model.encode_audio(prompt.input_features)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_bf16_runs_and_mostly_agrees(tiny_dir, tiny_model):
    bf = NxDVoxtralSpecDec.from_pretrained(tiny_dir, dtype=torch.bfloat16, buckets=SMALL_BUCKETS)
    assert bf.model.lm_head.weight.dtype == torch.bfloat16
    prompt = tiny_model.prepare(noise(3.0), sampling_rate=16000)
    a = tiny_model.generate(prompt.input_ids, prompt.input_features, max_new_tokens=8)[0].tolist()
    b = bf.generate(prompt.input_ids, prompt.input_features, max_new_tokens=8)[0].tolist()
    assert len(b) == 8 and a[0] == b[0]
