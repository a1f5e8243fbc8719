"""Speculative decoding: output equals plain greedy of the same target for every draft kind, K, audio length,
and when EOS or max_new_tokens falls inside an accepted block; stats add up."""
import json
import shutil

import pytest

from nxdi_voxtral import ConfigError, DraftMismatchError, NxDVoxtralSpecDec
from nxdi_voxtral.speculative import ngram_propose

from conftest import SMALL_BUCKETS, noise

AUDIO_CASES = [(3.0, 0, 40), (41.0, 1, 33), (7.5, 2, 17)]  # seconds, seed, max_new_tokens (41 s: 2 chunks)
K_CASES = [("layers_high", 1), ("layers_high", 2), ("layers_high", 4), ("layers_high", 7), ("layers_low", 2),
           ("layers_low", 7), ("dflash", 1), ("dflash", 4), ("dflash", 7), ("dflash", 15), ("ngram", 1),
           ("ngram", 2), ("ngram", 4), ("ngram", 7)]


@pytest.fixture(scope="module")
def reference(spec_models):
    """Plain greedy of the target, per audio case."""
    plain = spec_models["plain"]
    out = {}
    for seconds, seed, n in AUDIO_CASES:
        p = plain.prepare(noise(seconds, seed=seed), sampling_rate=16000)
        out[(seconds, seed)] = (p, plain.generate(p.input_ids, p.input_features, max_new_tokens=n)[0].tolist())
        assert len(set(out[(seconds, seed)][1])) >= n // 3, "degenerate fixture"
    return out


def load(spec_dirs, draft, k):
    kind = draft.split("_")[0]
    return NxDVoxtralSpecDec.from_pretrained(spec_dirs["target"], draft=spec_dirs.get(draft), draft_kind=kind,
                                             num_speculative_tokens=k, buckets=SMALL_BUCKETS)


def check_stats(stats, ids, kind, max_new):
    steps = stats.steps
    assert stats.generated == len(ids)
    assert stats.target_passes == 1 + len(steps)
    assert stats.verify_calls == sum(1 for p, _, _ in steps if p)
    assert sum(e for _, _, e in steps) == len(ids) - 1
    assert all(e == a + 1 for _, a, e in steps[:-1])  # only the last step may be cut by EOS / max_new_tokens
    assert all(0 <= a <= len(p) <= stats.k for p, a, _ in steps)
    verified = [e for p, _, e in steps if p]  # tau counts emitted tokens only (issue 13)
    assert stats.tau == pytest.approx(sum(verified) / len(verified) if verified else 0.0)
    expected_draft_passes = {"layers": 1 + stats.verify_calls, "dflash": 1 + stats.verify_calls, "ngram": 0}
    assert stats.draft_passes == expected_draft_passes[kind]


@pytest.mark.parametrize("draft,k", K_CASES)
def test_speculative_equals_greedy(spec_dirs, reference, draft, k):
    m = load(spec_dirs, draft, k)
    for seconds, seed, n in AUDIO_CASES:
        p, ref = reference[(seconds, seed)]
        ids, stats = m.generate(p.input_ids, p.input_features, max_new_tokens=n, return_stats=True)
        assert ids[0].tolist() == ref, (draft, k, seconds)
        check_stats(stats, ref, m.draft_kind, n)
    if draft == "layers_high" and k >= 4:
        assert stats.tau > 2.5, "high-acceptance fixture should accept long runs"


@pytest.mark.parametrize("draft,k", [("layers_high", 7), ("layers_high", 4), ("dflash", 15), ("ngram", 4)])
def test_max_new_tokens_inside_accepted_block(spec_dirs, reference, draft, k):
    m = load(spec_dirs, draft, k)
    p, ref = reference[(3.0, 0)]
    for n in range(1, 41):
        ids = m.generate(p.input_ids, p.input_features, max_new_tokens=n)[0].tolist()
        assert ids == ref[:n], n


def with_eos(spec_dirs, tmp_path, eos_id):
    d = tmp_path / f"target_eos{eos_id}"
    shutil.copytree(spec_dirs["target"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"]["eos_token_id"] = eos_id
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("draft,k", [("layers_high", 7), ("layers_high", 3), ("dflash", 15), ("ngram", 3)])
def test_eos_inside_accepted_block(spec_dirs, reference, tmp_path, draft, k):
    """Declare a token that greedy emits mid-run to be EOS: both loops must stop right after it."""
    p, ref = reference[(3.0, 0)]
    m = load(spec_dirs, draft, k)
    _, stats = m.generate(p.input_ids, p.input_features, max_new_tokens=40, return_stats=True)
    # positions that are strictly inside an accepted run (not the bonus token closing a step)
    inside, pos = [], 1
    for _, a, e in stats.steps:
        inside += list(range(pos, pos + min(a, e)))
        pos += e
    firsts = [j for j in range(1, 40) if ref.index(ref[j]) == j]
    candidates = [j for j in firsts if j in inside] or firsts
    for j in candidates[:3]:
        d = with_eos(spec_dirs, tmp_path, ref[j])
        plain = NxDVoxtralSpecDec.from_pretrained(d, buckets=SMALL_BUCKETS)
        spec = NxDVoxtralSpecDec.from_pretrained(d, draft=spec_dirs.get(draft), draft_kind=draft.split("_")[0],
                                                 num_speculative_tokens=k, buckets=SMALL_BUCKETS)
        greedy = plain.generate(p.input_ids, p.input_features, max_new_tokens=40)[0].tolist()
        assert greedy == ref[:j + 1]
        assert spec.generate(p.input_ids, p.input_features, max_new_tokens=40)[0].tolist() == greedy
    if draft == "layers_high":
        assert any(j in inside for j in candidates[:3]), "fixture never put EOS inside an accepted block"


def test_transcribe_reports_stats(spec_models):
    r = spec_models["layers"].transcribe(noise(3.0), sampling_rate=16000, max_new_tokens=20)
    plain = spec_models["plain"].transcribe(noise(3.0), sampling_rate=16000, max_new_tokens=20)
    assert r.token_ids == plain.token_ids and r.text == plain.text
    assert r.stats.tau > 1 and r.stats.target_passes < plain.stats.target_passes == 20
    assert r.stats.steps and all(isinstance(p, list) for p, _, _ in r.stats.steps)


def test_ngram_lookup():
    assert ngram_propose([5, 6, 7, 8, 5, 6], k=3) == [7, 8, 5]
    assert ngram_propose([1, 2, 3], k=2) == []
    assert ngram_propose([9, 1, 9, 2, 9], k=2) == [2, 9]  # latest occurrence wins
    assert ngram_propose([4, 4, 4], k=5) == [4]


def test_draft_loader_errors(spec_dirs, tmp_path, ckpt_factory):
    t = spec_dirs["target"]
    with pytest.raises(ConfigError, match="needs a draft checkpoint"):
        NxDVoxtralSpecDec.from_pretrained(t, draft_kind="layers", buckets=SMALL_BUCKETS)
    with pytest.raises(ConfigError, match="draft_kind must be one of"):
        NxDVoxtralSpecDec.from_pretrained(t, draft_kind="medusa", buckets=SMALL_BUCKETS)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        NxDVoxtralSpecDec.from_pretrained(t, draft_kind="ngram", num_speculative_tokens=0, buckets=SMALL_BUCKETS)
    other = ckpt_factory("gqa8_hd8")  # vocabulary 4096 vs 2048
    with pytest.raises(DraftMismatchError, match="vocabulary size 4096 != target's 2048"):
        NxDVoxtralSpecDec.from_pretrained(t, draft=other, draft_kind="layers", buckets=SMALL_BUCKETS)
    d = tmp_path / "tok"
    shutil.copytree(spec_dirs["layers_high"], d)
    tok = json.loads((d / "tekken.json").read_text())
    tok["vocab"][1500]["token_str"] = "changed"
    (d / "tekken.json").write_text(json.dumps(tok))
    with pytest.raises(DraftMismatchError, match="tekken.json differs"):
        NxDVoxtralSpecDec.from_pretrained(t, draft=d, draft_kind="layers", buckets=SMALL_BUCKETS)

    def dflash_with(**changes):
        d = tmp_path / f"df{len(list(tmp_path.iterdir()))}"
        shutil.copytree(spec_dirs["dflash"], d)
        cfg = json.loads((d / "config.json").read_text())
        for key, v in changes.items():
            if key in ("target_layer_ids", "mask_token_id"):
                cfg["dflash_config"][key] = v
            else:
                cfg[key] = v
        (d / "config.json").write_text(json.dumps(cfg))
        return d
    cases = [(dict(target_layer_ids=[0, 4]), "target_layer_ids \\[4\\] out of range"),
             (dict(hidden_size=128), "hidden size 128 != target's 64"),
             (dict(mask_token_id=2048), "mask_token_id 2048 is outside the target vocabulary")]
    for changes, match in cases:
        with pytest.raises(DraftMismatchError, match=match):
            NxDVoxtralSpecDec.from_pretrained(t, draft=dflash_with(**changes), draft_kind="dflash",
                                              buckets=SMALL_BUCKETS)
    with pytest.raises(DraftMismatchError, match="proposes at most 15"):
        NxDVoxtralSpecDec.from_pretrained(t, draft=spec_dirs["dflash"], draft_kind="dflash",
                                          num_speculative_tokens=16, buckets=SMALL_BUCKETS)


def test_layer_draft_shares_target_modules_when_identical(spec_models):
    m = spec_models["layers"]
    assert m.draft.language_model.embed_tokens is m.model.language_model.embed_tokens
    assert m.draft.lm_head is m.model.lm_head
    assert not m.setup.draft_own_audio and m.draft.audio_tower is m.model.audio_tower
