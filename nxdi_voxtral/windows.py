"""Long audio as a sequence of windows, cut at quiet points, decoded block by block.

Audio longer than the largest audio bucket is transcribed one window at a time. `audio_windows` reads the input
(a path, the bytes of an upload or an array) as a stream of mono blocks at the source rate, cuts a window every
`window_s` seconds at the quietest 20 ms frame of the last `search_s` seconds before that limit (so a cut falls
in a pause rather than inside a word), and resamples each window on its own to 16 kHz mono float32, as
`processing.load_audio` does for a whole clip. At most one window plus one 20 ms frame of look-ahead of
source-rate samples is held, however long the file.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from .errors import AudioError, ConfigError
from .processing import BLOCK_FRAMES, array_mono, check_file, check_header, decoded_blocks, load_audio

FRAME_SECONDS = 0.02  # the energy frame of cut_point: 20 ms, shorter than a pause between words


@dataclass
class Window:
    """One window of the original audio: its position (seconds of the original audio, end exclusive) and its
    samples as 16 kHz mono float32."""
    index: int
    start_s: float
    end_s: float
    samples: np.ndarray


def frame_length(sr: int) -> int:
    """Samples in one 20 ms energy frame at `sr` Hz."""
    return max(1, round(FRAME_SECONDS * sr))


def cut_point(samples: np.ndarray, sr: int, limit: int, search: int) -> int:
    """The quietest point of samples[limit - search : limit], as an absolute sample index.

    The region is tiled with 20 ms frames ending at `limit` (a partial frame at its start is left out); the
    result is the centre of the frame of lowest RMS energy, the latest one on a tie so that windows are as long
    as possible. A region shorter than one frame gives `limit` (a plain cut at the limit)."""
    if not 0 <= limit <= len(samples):
        raise ValueError(f"limit {limit} is outside the {len(samples)} samples")
    frame = frame_length(sr)
    n_frames = min(max(search, 0), limit) // frame
    if n_frames == 0:
        return limit
    first = limit - n_frames * frame
    # mean square ranks frames as RMS does; float64 so that the sums do not depend on float32 rounding
    energy = np.square(samples[first:limit], dtype=np.float64).reshape(n_frames, frame).mean(axis=1)
    latest_quietest = n_frames - 1 - int(np.argmin(energy[::-1]))  # argmin takes the first: search reversed
    return first + latest_quietest * frame + frame // 2


def audio_windows(audio, sampling_rate: int | None = None, *, window_s: float, search_s: float,
                  max_seconds: float | None, strict: bool = False) -> Iterator[Window]:
    """Windows of at most `window_s` seconds covering `audio` in order, each cut at the quietest 20 ms frame of
    the `search_s` seconds before its limit. `audio` is what `processing.load_audio` takes: a path, the encoded
    bytes of an upload (wav / flac / ogg / mp3), or an array (numpy or torch) with its sampling_rate.

    The input is checked when this is called, before any sample is decoded: a missing or unreadable file, a
    sample rate that does not match `sampling_rate`, a duration over `max_seconds` (AudioTooLongError, from the
    container's header), a truncated file when `strict` (otherwise an AudioWarning) and, for arrays, an empty,
    non-finite or mis-shaped array. What only decoding reveals (non-finite samples, an empty file, a header that
    under-reports the length) is raised by the iteration, after the windows that precede it.

    A file is decoded block by block and only the current window plus its look-ahead are held; an array is cut
    by the same rule. Each window's samples are what `load_audio` gives for that stretch of source-rate samples
    (resampled on its own), so audio no longer than one window gives one window equal to `load_audio(audio)`.
    """
    if isinstance(audio, (str, Path)):
        what = str(audio)
        check_file(Path(audio), what)
        sr = check_header(lambda: what, what, sampling_rate, max_seconds, strict, windowed_limit)
        blocks = decoded_blocks(lambda: what, what, sr, max_seconds, windowed_limit)
    elif isinstance(audio, (bytes, bytearray, memoryview)):
        what = "uploaded audio"
        if not len(audio):
            raise AudioError(f"{what}: the file is empty")
        sr = check_header(lambda: io.BytesIO(audio), what, sampling_rate, max_seconds, strict, windowed_limit)
        blocks = decoded_blocks(lambda: io.BytesIO(audio), what, sr, max_seconds, windowed_limit)
    else:
        sr = sampling_rate
        samples = array_mono(audio, sampling_rate, max_seconds, windowed_limit)
        # views of the array, so that the windowing copies one window at a time as it does for a file
        blocks = (samples[i:i + BLOCK_FRAMES] for i in range(0, len(samples), BLOCK_FRAMES))
    limit, search = round(window_s * sr), round(search_s * sr)
    if search < 0 or limit - search < frame_length(sr):
        raise ConfigError(f"window_s={window_s} and search_s={search_s}: search_s must be >= 0 and window_s must "
                          f"exceed it by at least one {FRAME_SECONDS * 1000:g} ms frame")
    return _windows(blocks, sr, limit, search)


def windowed_limit(max_seconds: float) -> str:
    """Why audio over max_seconds is refused when it is windowed: the limit is on the whole input."""
    return f"windowed transcription takes at most {max_seconds:g} s"


def _windows(blocks: Iterable[np.ndarray], sr: int, limit: int, search: int) -> Iterator[Window]:
    """Cut a stream of mono blocks at `sr` into windows of at most `limit` samples.

    The buffer holds one window plus one frame of look-ahead: once it is full, audio follows the limit and the
    window is cut at cut_point; at the end of the stream, what is left is the last window. The look-ahead keeps
    the last window at least one frame long (a window of a sample or two would resample to nothing)."""
    frame = frame_length(sr)
    buf = np.empty(limit + frame, np.float32)
    held = 0   # samples in buf
    start = 0  # buf[0]'s index in the whole audio
    index = 0

    def cut(at: int) -> Window:
        nonlocal held, start, index
        # load_audio's own array path (checks and resampler), on a copy since buf is reused
        window = Window(index, start / sr, (start + at) / sr, load_audio(buf[:at].copy(), sr))
        buf[:held - at] = buf[at:held]
        held, start, index = held - at, start + at, index + 1
        return window

    for block in blocks:
        while len(block):
            take = min(len(block), len(buf) - held)
            buf[held:held + take] = block[:take]
            held, block = held + take, block[take:]
            if held == len(buf):
                yield cut(cut_point(buf, sr, limit, search))
    if held > limit:  # the audio ends less than a frame past the limit: cut earlier, leaving a frame at least
        yield cut(cut_point(buf, sr, held - frame, search))
    if held:
        yield cut(held)
