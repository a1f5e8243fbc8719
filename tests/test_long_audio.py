"""Long audio: beyond the largest audio bucket it is cut into windows at quiet points, the windows run as sequences
of one batch, and their texts are joined in order, one segment each; a few minutes of synthetic audio on the tiny
model with 30 s buckets."""
from dataclasses import replace

import numpy as np
import pytest
import soundfile as sf

from conftest import SMALL_BUCKETS
from serve_helpers import speech_like
from nxdi_voxtral import AudioTooLongError, NxDVoxtralSpecDec
from nxdi_voxtral import application
from nxdi_voxtral import generate as gen

SR = 16000


@pytest.fixture(scope="module")
def long_model(tiny_dir):
    return NxDVoxtralSpecDec.from_pretrained(tiny_dir, buckets=replace(SMALL_BUCKETS, audio_chunks=(1,)),
                                             max_batch_size=4)


def test_long_audio_windows_joined_in_order_each_exact(long_model, tmp_path):
    m = long_model
    audio = speech_like(150.0)
    path = tmp_path / "long.flac"
    sf.write(path, audio, SR)
    r = m.transcribe(path, max_new_tokens=10)
    segs = r.segments
    assert len(segs) >= 5 and segs[0].start == 0.0 and segs[-1].end == pytest.approx(150.0, abs=1e-6)
    assert all(a.end == b.start for a, b in zip(segs, segs[1:]))
    assert all(s.end - s.start <= m.buckets.max_audio_seconds(m.cfg) for s in segs)
    assert r.text == " ".join(s.text.strip() for s in segs)
    assert r.token_ids == [t for s in segs for t in s.token_ids]
    # each window's transcript is exactly that window transcribed alone (batch 1, no windowing involved)
    for s in segs:
        clip = audio[round(s.start * SR):round(s.end * SR)]
        alone = m.transcribe(clip, sampling_rate=SR, max_new_tokens=10)
        assert alone.token_ids == s.token_ids and len(alone.segments) == 1
    # cuts at quiet points: the samples around each cut are silent in this audio
    for s in segs[1:]:
        cut = round(s.start * SR)
        assert np.abs(audio[cut - 80:cut + 80]).max() == 0.0, s.start
    # the same file again: the same windows and transcript (deterministic cuts)
    again = m.transcribe(path.read_bytes(), max_new_tokens=10)
    assert [(s.start, s.end, s.token_ids) for s in again.segments] == [(s.start, s.end, s.token_ids) for s in segs]


def test_windows_are_pulled_as_slots_free(long_model, monkeypatch):
    """At most a batch of windows' prompts exist ahead of the finished ones: a long file never has all its windows'
    features in memory."""
    built, released, worst = [0], [0], [0]
    real_build, real_release = application.build_prompt, gen.Batch.release

    def build(*a, **kw):
        built[0] += 1
        worst[0] = max(worst[0], built[0] - released[0])
        return real_build(*a, **kw)

    def release(self, seq):
        released[0] += 1
        return real_release(self, seq)

    monkeypatch.setattr(application, "build_prompt", build)
    monkeypatch.setattr(gen.Batch, "release", release)
    r = long_model.transcribe(speech_like(280.0, seed=1), sampling_rate=SR, max_new_tokens=4)
    assert len(r.segments) >= 9 and built[0] == len(r.segments)
    assert worst[0] <= long_model.buckets.max_batch


def test_too_long_refused_before_any_generation(long_model, tmp_path, monkeypatch):
    path = tmp_path / "long.wav"
    sf.write(path, speech_like(100.0), SR)
    monkeypatch.setattr(NxDVoxtralSpecDec, "start", lambda *a, **k: pytest.fail("generation started"))
    with pytest.raises(AudioTooLongError):
        long_model.transcribe(path, max_audio_s=90.0)
    with pytest.raises(AudioTooLongError):
        long_model.transcribe([speech_like(5.0), speech_like(100.0)], sampling_rate=SR, max_audio_s=90.0)
