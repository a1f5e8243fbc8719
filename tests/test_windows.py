"""Long audio cut into windows at quiet points (nxdi_voxtral.windows): cuts fall in pauses, windows cover the audio
exactly, the input is checked before decoding, and a long file is streamed with bounded memory."""
import tracemalloc
import warnings

import numpy as np
import pytest
import soundfile as sf
import torch

from nxdi_voxtral import AudioError, AudioTooLongError, ConfigError
from nxdi_voxtral.processing import AudioWarning, load_audio
from nxdi_voxtral.windows import audio_windows, cut_point, frame_length

from serve_helpers import wav_bytes

WINDOW_S, SEARCH_S = 20.0, 5.0


def speech_like(seconds: float, sr: int, channels: int = 1, seed: int = 0):
    """Synthetic speech: "words" (a tone plus noise, 0.2-1.5 s, no fade so every 20 ms of a word has energy)
    separated by silent gaps (0.15-0.8 s of exact zeros). Returns the samples ([n] or [n, channels]) and the gaps
    as [start, end) sample ranges."""
    rng = np.random.RandomState(seed)
    n = int(seconds * sr)
    out = np.zeros((n, channels), np.float32)
    gaps, pos = [], 0
    while pos < n:
        gap = int(rng.uniform(0.15, 0.8) * sr)
        gaps.append((pos, min(pos + gap, n)))
        pos += gap
        word = min(int(rng.uniform(0.2, 1.5) * sr), max(n - pos, 0))
        t = np.arange(word) / sr
        for c in range(channels):
            out[pos:pos + word, c] = 0.3 * np.sin(2 * np.pi * rng.uniform(150, 3000) * t) + 0.1 * rng.randn(word)
        pos += word
    return (out[:, 0] if channels == 1 else out), gaps


@pytest.fixture(scope="module", params=[(16000, 1, "WAV"), (44100, 2, "FLAC")],
                ids=["16k_mono_wav", "44k_stereo_flac"])
def long_clip(request, tmp_path_factory):
    """About three minutes of speech_like audio written to a file: (path, sample rate, gaps, frames)."""
    sr, channels, fmt = request.param
    samples, gaps = speech_like(185.0, sr, channels)
    path = tmp_path_factory.mktemp("windows") / f"long.{fmt.lower()}"
    sf.write(path, samples, sr, format=fmt, subtype="PCM_16")
    return path, sr, gaps, len(samples)


def windows_of(audio, sampling_rate=None, window_s=WINDOW_S, search_s=SEARCH_S, **kw):
    return list(audio_windows(audio, sampling_rate, window_s=window_s, search_s=search_s, max_seconds=None, **kw))


def same_windows(a, b) -> bool:
    return len(a) == len(b) and all(
        (x.index, x.start_s, x.end_s) == (y.index, y.start_s, y.end_s) and np.array_equal(x.samples, y.samples)
        for x, y in zip(a, b))


def test_every_cut_falls_in_a_silent_gap(long_clip):
    path, sr, gaps, _ = long_clip
    wins = windows_of(path)
    assert len(wins) >= 185 // WINDOW_S
    starts = np.array([g[0] for g in gaps])
    for w in wins[:-1]:
        cut = round(w.end_s * sr)
        g0, g1 = gaps[np.searchsorted(starts, cut, side="right") - 1]
        assert g0 <= cut < g1, f"window {w.index} is cut at {cut / sr:.3f} s, inside a word"


def test_windows_cover_the_audio_exactly_in_order(long_clip):
    path, sr, _, frames = long_clip
    wins = windows_of(path)
    assert [w.index for w in wins] == list(range(len(wins)))
    assert wins[0].start_s == 0.0 and wins[-1].end_s == frames / sr
    for a, b in zip(wins, wins[1:]):
        assert b.start_s == a.end_s
    for w in wins:
        n = round(w.end_s * sr) - round(w.start_s * sr)  # exact: the bounds are sample indices / sr
        assert 0 < n <= WINDOW_S * sr
        assert w.samples.dtype == np.float32 and w.samples.ndim == 1 and w.samples.flags.c_contiguous
        assert len(w.samples) == round(n * 16000 / sr)  # each window resampled on its own
    if sr == 16000:  # no resampling: the windows are load_audio's samples, split
        np.testing.assert_array_equal(np.concatenate([w.samples for w in wins]), load_audio(path))


def test_windows_are_deterministic(long_clip):
    path = long_clip[0]
    assert same_windows(windows_of(path), windows_of(path))


def test_upload_bytes_and_arrays_window_as_the_file_does(long_clip):
    path, sr, _, _ = long_clip
    wins = windows_of(path)
    assert same_windows(windows_of(path.read_bytes()), wins)
    assert same_windows(windows_of(str(path)), wins)
    # an array is cut by the same rule: the file's samples as an array give the same windows
    assert same_windows(windows_of(sf.read(path, dtype="float32")[0], sr), wins)
    if sr == 16000:
        assert same_windows(windows_of(torch.from_numpy(sf.read(path, dtype="int16")[0]), sr), wins)


@pytest.mark.parametrize("sr,channels", [(16000, 1), (44100, 2), (8000, 1)])
@pytest.mark.parametrize("kind", ["path", "bytes", "array"])
def test_short_clip_is_one_window_equal_to_load_audio(tmp_path, sr, channels, kind):
    samples, _ = speech_like(7.3, sr, channels, seed=5)
    path = tmp_path / "short.flac"
    sf.write(path, samples, sr)
    audio, rate = {"path": (path, None), "bytes": (path.read_bytes(), None), "array": (samples, sr)}[kind]
    [w] = windows_of(audio, rate, window_s=8.0, search_s=2.0)
    assert (w.index, w.start_s, w.end_s) == (0, 0.0, len(samples) / sr)
    assert np.array_equal(w.samples, load_audio(audio, rate))


def test_over_long_input_is_refused_before_any_decoding(tmp_path, monkeypatch):
    data = wav_bytes(np.zeros(65 * 8000, np.float32), 8000, fmt="FLAC")
    path = tmp_path / "long.flac"
    path.write_bytes(data)
    decoded = []
    for name in ("blocks", "read"):
        monkeypatch.setattr(sf.SoundFile, name, lambda *a, **k: decoded.append(a) or iter(()))
    for audio in (data, path):
        # refused by the call itself, from the header: no window is asked for, no block is decoded
        with pytest.raises(AudioTooLongError, match=r"65.0 s of audio \(from the file header\) is too long"):
            audio_windows(audio, window_s=10.0, search_s=2.0, max_seconds=60.0)
    with pytest.raises(AudioTooLongError, match=r"65.0 s of audio \(520000 samples at 8000 Hz\)"):
        audio_windows(np.zeros(65 * 8000, np.float32), 8000, window_s=10.0, search_s=2.0, max_seconds=60.0)
    assert decoded == []
    monkeypatch.undo()
    wins = list(audio_windows(data, window_s=10.0, search_s=2.0, max_seconds=70.0))  # within the limit
    assert wins[-1].end_s == 65.0 and sum(len(w.samples) for w in wins) == 65 * 16000


def test_bad_inputs_raise_load_audios_errors(tmp_path):
    def call(audio, sampling_rate=None, **kw):
        return audio_windows(audio, sampling_rate, window_s=10.0, search_s=2.0, max_seconds=None, **kw)
    with pytest.raises(AudioError, match="no such audio file"):
        call(tmp_path / "missing.wav")
    with pytest.raises(AudioError, match="is a directory"):
        call(tmp_path)
    with pytest.raises(AudioError, match="the file is empty"):
        call(b"")
    with pytest.raises(AudioError, match="cannot decode as audio"):
        call(b"not audio at all" * 100)
    with pytest.raises(AudioError, match="file is 16000 Hz but sampling_rate=8000"):
        call(wav_bytes(np.zeros(1600, np.float32)), 8000)
    for samples, sr, match in [(np.zeros(0, np.float32), 16000, "empty"),
                               (np.array([0.1, np.nan] * 100, np.float32), 16000, "NaN or infinite"),
                               (np.zeros(1600, np.float32), None, "needs its sampling_rate"),
                               (np.zeros((3, 400, 400), np.float32), 16000, "shape"),
                               (np.zeros(1600, np.float32), 10 ** 9, "sample rate")]:
        with pytest.raises(AudioError, match=match):
            call(samples, sr)
    # what only decoding shows comes from the iteration, as load_audio raises it for the whole file
    empty = tmp_path / "empty.wav"
    sf.write(empty, np.zeros(0, np.float32), 16000)
    with pytest.raises(AudioError, match="audio is empty"):
        list(call(empty))
    bad = np.zeros(25 * 16000, np.float32)
    bad[15 * 16000] = np.nan
    gen = call(wav_bytes(bad, subtype="FLOAT"))
    assert next(gen).end_s <= 10.0  # the windows before the bad sample come out first
    with pytest.raises(AudioError, match="uploaded audio: audio contains NaN or infinite samples"):
        list(gen)


def test_window_and_search_lengths_are_checked():
    for window_s, search_s in [(5.0, 5.0), (5.0, 6.0), (5.0, -1.0), (0.01, 0.0)]:
        with pytest.raises(ConfigError, match="search_s"):
            audio_windows(np.zeros(16000, np.float32), 16000, window_s=window_s, search_s=search_s, max_seconds=None)


def test_truncated_file_warns_or_is_refused_with_strict(tmp_path):
    full = tmp_path / "full.wav"
    sf.write(full, speech_like(30.0, 16000)[0], 16000, subtype="PCM_16")
    cut = tmp_path / "cut.wav"
    cut.write_bytes(full.read_bytes()[:44 + 25 * 16000 * 2])
    with pytest.warns(AudioWarning, match="truncated file: the header announces 960000 bytes"):
        wins = windows_of(cut, window_s=10.0, search_s=2.0)
    assert wins[-1].end_s == 25.0
    with pytest.raises(AudioError, match="truncated"):
        audio_windows(cut, window_s=10.0, search_s=2.0, max_seconds=None, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        windows_of(full, window_s=10.0, search_s=2.0)  # an intact file: no warning


def test_the_last_window_keeps_at_least_a_frame():
    """Audio ending just past a window's limit is cut earlier, so the last window is not a sample or two (which
    would resample to nothing)."""
    sr, frame = 44100, frame_length(44100)
    limit = 44100
    for extra in (1, 2, frame - 1, frame, frame + 1):
        wins = windows_of(np.zeros(limit + extra, np.float32), sr, window_s=1.0, search_s=0.5)
        assert len(wins) == 2 and wins[1].end_s == (limit + extra) / sr
        assert round((wins[1].end_s - wins[1].start_s) * sr) >= frame and len(wins[1].samples) > 0
    assert len(windows_of(np.zeros(limit, np.float32), sr, window_s=1.0, search_s=0.5)) == 1


def test_long_file_is_streamed_with_bounded_memory(tmp_path):
    """22 minutes of 16 kHz FLAC (mostly silence, a word every 10 s): iterating the windows (and dropping each)
    must hold a small part of the decoded file (85 MB), not the whole of it."""
    sr, minutes = 16000, 22
    path = tmp_path / "long.flac"
    word = (0.3 * np.sin(2 * np.pi * 440 * np.arange(sr) / sr)).astype(np.float32)
    minute = np.concatenate([word, np.zeros(9 * sr, np.float32)] * 6)
    with sf.SoundFile(path, "w", sr, 1, format="FLAC") as f:  # written a minute at a time
        for _ in range(minutes):
            f.write(minute)
    decoded_bytes = minutes * 60 * sr * 4
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        n, end = 0, 0.0
        for w in audio_windows(path, window_s=15.0, search_s=3.0, max_seconds=None):
            n, end = n + 1, w.end_s
            del w
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert end == minutes * 60 and n >= minutes * 60 / 15
    assert peak < 0.1 * decoded_bytes, f"peak {peak / 1e6:.1f} MB while windowing {decoded_bytes / 1e6:.0f} MB"


def test_cut_point_takes_the_quietest_frame():
    sr, frame = 16000, frame_length(16000)
    assert frame == 320
    x = np.random.RandomState(0).randn(10 * frame).astype(np.float32)
    quiet = x.copy()
    quiet[3 * frame:4 * frame] *= 0.01  # frame 3 of 10, counting from the start of the region at 0
    assert cut_point(quiet, sr, 10 * frame, 10 * frame) == 3 * frame + frame // 2
    # frames are laid from the limit backwards: a region not a whole number of frames leaves out its first part
    assert cut_point(quiet, sr, 10 * frame, 10 * frame - 5) == 3 * frame + frame // 2
    quieter = quiet.copy()
    quieter[7 * frame:8 * frame] *= 0.001
    assert cut_point(quieter, sr, 10 * frame, 10 * frame) == 7 * frame + frame // 2
    # the region only: the quiet frame 3 is outside the last 5 frames, so the quietest of those is taken
    e = [np.mean(quiet[i * frame:(i + 1) * frame] ** 2.0) for i in range(5, 10)]
    assert cut_point(quiet, sr, 10 * frame, 5 * frame) == (5 + int(np.argmin(e))) * frame + frame // 2


def test_cut_point_ties_go_to_the_latest_frame_and_short_regions_to_the_limit():
    sr, frame = 44100, frame_length(44100)
    assert frame == 882
    x = np.ones(20 * frame, np.float32)
    x[2 * frame:3 * frame] = 0.0
    x[12 * frame:13 * frame] = 0.0
    assert cut_point(x, sr, 20 * frame, 20 * frame) == 12 * frame + frame // 2
    assert cut_point(np.zeros(20 * frame, np.float32), sr, 15 * frame, 4 * frame) == 14 * frame + frame // 2
    assert cut_point(x, sr, 15 * frame, frame - 1) == 15 * frame  # shorter than a frame: cut at the limit
    assert cut_point(x, sr, 15 * frame, 0) == 15 * frame
    assert cut_point(x, sr, frame // 2, 10 * frame) == frame // 2  # the region stops at the audio's start
    x2 = x.copy()
    assert cut_point(x, sr, 20 * frame, 20 * frame) == cut_point(x2, sr, 20 * frame, 20 * frame)
    with pytest.raises(ValueError, match="outside"):
        cut_point(x, sr, 21 * frame, frame)
