"""Audio -> prompt ids + features (vs transformers' VoxtralProcessor), and bad audio."""
import numpy as np
import pytest
import soundfile as sf
import torch

from nxdi_voxtral import AudioError, AudioTooLongError, ConfigError
from nxdi_voxtral.processing import load_audio

from conftest import noise
from serve_helpers import wav_bytes


@pytest.mark.parametrize("seconds", [3.0, 47.0])
def test_prompt_and_features_equal_transformers_processor(tiny_dir, tiny_model, tmp_path, seconds):
    from transformers import VoxtralProcessor, WhisperFeatureExtractor
    from transformers.tokenization_mistral_common import MistralCommonBackend
    proc = VoxtralProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=128),
                            tokenizer=MistralCommonBackend(tokenizer_path=str(tiny_dir / "tekken.json")))
    path = tmp_path / "clip.wav"
    sf.write(path, noise(seconds, seed=7), 16000, subtype="PCM_16")
    ref = proc.apply_transcription_request(language="en", audio=str(path), model_id="voxtral")
    ours = tiny_model.prepare(path, language="en")
    assert torch.equal(ours.input_ids, ref["input_ids"])
    torch.testing.assert_close(ours.input_features, ref["input_features"], rtol=0, atol=1e-5)


def test_prompt_layout_is_the_transcription_request(tiny_model):
    ids = tiny_model.prepare(noise(3.0), language="en", sampling_rate=16000).input_ids[0].tolist()
    assert ids[:3] == [1, 3, 25] and ids[3:378] == [24] * 375 and ids[378] == 4 and ids[-1] == 34
    assert tiny_model.tokenizer.decode(ids[379:-1]) == "lang:en"
    no_lang = tiny_model.prepare(noise(3.0), sampling_rate=16000).input_ids[0].tolist()
    assert no_lang[-2:] == [4, 34]


def test_resample_and_downmix(tiny_model):
    x16 = noise(2.0, seed=1)
    x8 = x16[::2].copy()
    assert load_audio(x8, 8000).shape == (32000,)
    stereo = np.stack([x16, 0.5 * x16], axis=1)
    np.testing.assert_allclose(load_audio(stereo, 16000), 0.75 * x16, rtol=1e-6)
    np.testing.assert_allclose(load_audio(stereo.T, 16000), 0.75 * x16, rtol=1e-6)
    r8 = tiny_model.transcribe(x8, sampling_rate=8000, max_new_tokens=4)
    r2 = tiny_model.transcribe(stereo, sampling_rate=16000, max_new_tokens=4)
    assert len(r8.token_ids) == 4 and len(r2.token_ids) == 4


def test_stereo_file_and_8khz_file(tiny_model, tmp_path):
    path = tmp_path / "st.flac"
    x = noise(2.0, seed=2, sr=8000)
    sf.write(path, np.stack([x, x], axis=1), 8000)
    r = tiny_model.transcribe(path, max_new_tokens=3)
    assert len(r.token_ids) == 3 and r.timings["audio_s"] == pytest.approx(2.0)


def test_all_zero_audio_transcribes(tiny_model):
    r = tiny_model.transcribe(np.zeros(16000, dtype=np.float32), sampling_rate=16000, max_new_tokens=5)
    assert len(r.token_ids) == 5 and isinstance(r.text, str)


@pytest.mark.parametrize("make,match", [
    (lambda p: p / "missing.wav", "no such audio file"),
    (lambda p: (p / "text.wav").write_text("this is not audio") and p / "text.wav", "cannot decode"),
    (lambda p: (sf.write(p / "empty.wav", np.zeros(0, np.float32), 16000), p / "empty.wav")[1], "empty"),
])
def test_bad_audio_files(tiny_model, tmp_path, make, match):
    with pytest.raises(AudioError, match=match):
        tiny_model.transcribe(make(tmp_path))


@pytest.mark.parametrize("samples,sr,match", [
    (np.zeros(0, np.float32), 16000, "empty"),
    (np.array([0.1, np.nan, 0.2] * 100, np.float32), 16000, "NaN or infinite"),
    (np.array([0.1, np.inf] * 100, np.float32), 16000, "NaN or infinite"),
    (np.zeros(1600, np.float32), None, "needs its sampling_rate"),
    (np.zeros((3, 400, 400), np.float32), 16000, "shape"),
    (np.array(["a", "b"]), 16000, "numbers"),
])
def test_bad_audio_arrays(tiny_model, samples, sr, match):
    with pytest.raises(AudioError, match=match):
        tiny_model.transcribe(samples, sampling_rate=sr)


def test_audio_longer_than_largest_bucket_names_the_limit(tiny_model):
    with pytest.raises(AudioTooLongError, match=r"largest audio bucket holds 2 \(60 s\)"):
        tiny_model.prepare(noise(61.0), sampling_rate=16000)  # one prompt: the bucket is the limit
    with pytest.raises(AudioTooLongError, match=r"windowed transcription takes at most 50 s"):
        tiny_model.transcribe(noise(61.0), sampling_rate=16000, max_audio_s=50)  # longer audio is windowed


def test_bad_language_and_max_new_tokens(tiny_model):
    with pytest.raises(ConfigError, match="language"):
        tiny_model.transcribe(noise(1.0), language="klingon", sampling_rate=16000)
    p = tiny_model.prepare(noise(1.0), sampling_rate=16000)
    for bad in (0, -3, 2.5):
        with pytest.raises(ConfigError, match="max_new_tokens"):
            tiny_model.generate(p.input_ids, p.input_features, max_new_tokens=bad)
    with pytest.raises(ConfigError, match="exceeds the largest KV bucket"):
        tiny_model.generate(p.input_ids, p.input_features, max_new_tokens=5000)
    # nothing left half-done: the model still generates the same tokens after the errors
    a = tiny_model.generate(p.input_ids, p.input_features, max_new_tokens=6)
    assert torch.equal(a, tiny_model.generate(p.input_ids, p.input_features, max_new_tokens=6))


def encoded(seconds: float, fmt: str, sr: int = 16000) -> bytes:
    return wav_bytes(noise(seconds, seed=3, sr=sr), sr, fmt=fmt)


@pytest.mark.parametrize("fmt", ["WAV", "FLAC", "OGG", "MP3"])
def test_uploaded_bytes_decode_as_the_file_does(fmt, tmp_path):
    data = encoded(2.0, fmt)
    path = tmp_path / f"clip.{fmt.lower()}"
    path.write_bytes(data)
    np.testing.assert_array_equal(load_audio(data), load_audio(path))


@pytest.mark.parametrize("fmt", ["WAV", "FLAC", "OGG", "MP3"])
def test_over_long_upload_is_refused_from_its_header_before_any_decoding(fmt, monkeypatch):
    """A small compressed upload can hold hours of audio: its length comes from the container's header and the
    refusal comes before a sample is decoded (no block is read)."""
    data = encoded(65.0, fmt, sr=8000)
    decoded = []
    for name in ("blocks", "read"):
        monkeypatch.setattr(sf.SoundFile, name, lambda *a, **k: decoded.append(a) or iter(()))
    with pytest.raises(AudioTooLongError, match="from the file header"):
        load_audio(data, max_seconds=60.0)
    assert decoded == []
    monkeypatch.undo()
    assert len(load_audio(data, max_seconds=70.0)) == 65 * 16000  # the same upload, within the limit


def test_empty_and_garbage_uploads_are_audio_errors():
    with pytest.raises(AudioError, match="empty"):
        load_audio(b"")
    with pytest.raises(AudioError, match="cannot decode as audio"):
        load_audio(b"not audio at all" * 100)
