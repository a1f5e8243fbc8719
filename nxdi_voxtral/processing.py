"""Audio in, prompt ids and log-mel features out; token ids back to text.

Audio -> 16 kHz mono float32 -> mistral-common TranscriptionRequest (pads to 30 s chunks and builds the prompt
[BOS][INST][BEGIN_AUDIO][AUDIO]*n[/INST] lang:xx [TRANSCRIBE]) -> Whisper log-mel (the features transformers'
Voxtral processor computes) split into 30 s chunks.
"""
from __future__ import annotations

import io
import os
import re
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from .config import HOP, N_FFT, SAMPLE_RATE  # noqa: F401  (importable from here too)
from .errors import AudioError, AudioTooLongError, CheckpointError, ConfigError

CHUNK_SECONDS = 30.0  # mistral-common pads audio to multiples of 30 s: one audio chunk


class AudioWarning(UserWarning):
    """Audio that is used but looks damaged (a truncated file)."""


@dataclass
class Prompt:
    input_ids: torch.Tensor       # [1, T] int64
    input_features: torch.Tensor  # [n_chunks, n_mels, frames] float32
    duration_s: float


def load_tokenizer(model_dir: str | Path):
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    path = Path(model_dir) / "tekken.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no tekken.json (the Voxtral tokenizer file)")
    try:
        tok = MistralTokenizer.from_file(str(path))
    except Exception as e:
        raise CheckpointError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
    if tok.instruct_tokenizer.tokenizer.audio is None:
        raise CheckpointError(f"{path}: tokenizer has no audio section; not a Voxtral tokenizer")
    return tok


MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 1000, 384000  # outside this a header is broken (or it is not speech audio)
INT_PCM_SCALE = {np.dtype(np.int8): 2.0 ** 7, np.dtype(np.int16): 2.0 ** 15, np.dtype(np.int32): 2.0 ** 31}
_TRUNCATED = re.compile(r"data\s*:\s*(\d+)\s*\(should be (\d+)\)")  # libsndfile's log of a short data chunk


def _to_mono(samples: np.ndarray, what: str) -> np.ndarray:
    if samples.ndim == 1:
        return samples
    if samples.ndim == 2:
        # soundfile's layout is (frames, channels); also accept (channels, frames) for a handful of channels
        if samples.shape[1] <= 8 and samples.shape[1] <= samples.shape[0]:
            return samples.mean(axis=1)
        if samples.shape[0] <= 8:
            return samples.mean(axis=0)
    raise AudioError(f"{what}: expected mono [samples] or multi-channel audio as [samples, channels] or "
                     f"[channels, samples] with at most 8 channels, got an array of shape {samples.shape}")


def _check_rate(sr, what: str) -> None:
    if not isinstance(sr, (int, np.integer)) or not MIN_SAMPLE_RATE <= sr <= MAX_SAMPLE_RATE:
        raise AudioError(f"{what}: sample rate {sr!r} Hz is outside {MIN_SAMPLE_RATE}-{MAX_SAMPLE_RATE} Hz "
                         f"(a broken header, or not audio this model can use)")


def bucket_limit(max_seconds: float) -> str:
    """Why audio over max_seconds is refused when it must fit one prompt: the largest audio bucket."""
    return (f"the largest audio bucket holds {max_seconds / CHUNK_SECONDS:g} ({max_seconds:g} s); rebuild with a "
            f"larger audio_chunks bucket")


def _check_duration(frames: int, sr: int, max_seconds: float | None, what: str, source: str, limit=bucket_limit):
    if max_seconds is not None and frames / sr > max_seconds:
        raise AudioTooLongError(f"{what}: {frames / sr:.1f} s of audio ({source}) is too long: {limit(max_seconds)}")


def check_file(path: Path, what: str) -> None:
    if not path.exists():
        raise AudioError(f"{what}: no such audio file")
    if path.is_dir():
        raise AudioError(f"{what}: is a directory, not an audio file")
    if not os.access(path, os.R_OK):
        raise AudioError(f"{what}: permission denied (the file is not readable by this user)")


def _read_file(path: Path, sampling_rate, max_seconds, strict: bool) -> tuple[np.ndarray, int]:
    what = str(path)
    check_file(path, what)
    return _decode(lambda: what, what, sampling_rate, max_seconds, strict)


def audio_header(open_source, what: str) -> tuple[int, int, str]:
    """(frames, sample rate, libsndfile's notes) from the container's header (WAV, FLAC, OGG, MP3), without
    decoding the audio. open_source() gives a path or a fresh file object."""
    try:
        info = sf.info(open_source())
    except Exception as e:
        raise AudioError(f"{what}: cannot decode as audio ({type(e).__name__}: {e})") from None
    _check_rate(info.samplerate, what)
    return info.frames, info.samplerate, info.extra_info or ""


def check_header(open_source, what: str, sampling_rate, max_seconds, strict: bool, limit=bucket_limit) -> int:
    """What the header tells before any decoding: the rate (against sampling_rate), the duration (against
    max_seconds) and a truncated data chunk (AudioWarning, or AudioError when strict) -> the file's sample rate."""
    frames, sr, notes = audio_header(open_source, what)
    if sampling_rate is not None and sampling_rate != sr:
        raise AudioError(f"{what}: file is {sr} Hz but sampling_rate={sampling_rate} was given")
    _check_duration(frames, sr, max_seconds, what, "from the file header", limit)
    short = _TRUNCATED.search(notes)
    if short:
        msg = (f"{what}: truncated file: the header announces {short.group(1)} bytes of audio data, "
               f"{short.group(2)} are present")
        if strict:
            raise AudioError(msg)
        warnings.warn(msg + "; transcribing the part present", AudioWarning, stacklevel=4)
    return sr


BLOCK_FRAMES = 1 << 16  # frames per decoded block


def decoded_blocks(open_source, what: str, sr: int, max_seconds: float | None, limit=bucket_limit):
    """The file decoded block by block, each mixed down to mono as it comes (memory: one mono block however many
    channels), checking what the header could not: finite samples, a non-empty file, and a length the header
    under-reported."""
    max_frames = None if max_seconds is None else int(max_seconds * sr) + 1
    total = 0
    try:
        f = sf.SoundFile(open_source())
    except Exception as e:
        raise AudioError(f"{what}: cannot decode as audio ({type(e).__name__}: {e})") from None
    with f:
        decoded = f.blocks(blocksize=BLOCK_FRAMES, dtype="float32", always_2d=True)
        while True:
            # only the decoder's own failures become AudioError, not what a consumer throws in at the yield
            try:
                block = next(decoded, None)
            except Exception as e:
                raise AudioError(f"{what}: cannot decode as audio ({type(e).__name__}: {e})") from None
            if block is None:
                break
            mono = block[:, 0].copy() if block.shape[1] == 1 else block.mean(axis=1, dtype=np.float32)
            if not np.isfinite(mono).all():
                raise AudioError(f"{what}: audio contains NaN or infinite samples")
            total += len(mono)
            if max_frames is not None and total > max_frames:
                _check_duration(total, sr, max_seconds, what, "while decoding", limit)
            yield mono
    if total == 0:
        raise AudioError(f"{what}: audio is empty (0 samples)")


def _decode(open_source, what: str, sampling_rate, max_seconds, strict: bool) -> tuple[np.ndarray, int]:
    """Duration, rate and integrity from the header first; then decode block by block, so that an over-long file is
    refused before a sample is decoded (a header that under-reports the length is caught while decoding)."""
    sr = check_header(open_source, what, sampling_rate, max_seconds, strict)
    return np.concatenate(list(decoded_blocks(open_source, what, sr, max_seconds))), sr


def _array_samples(audio, sampling_rate) -> np.ndarray:
    what = "audio array"
    if sampling_rate is None:
        raise AudioError("an audio array needs its sampling_rate")
    samples = audio.numpy() if isinstance(audio, torch.Tensor) else np.asarray(audio)
    if samples.dtype == np.bool_ or not np.issubdtype(samples.dtype, np.number) or np.iscomplexobj(samples):
        raise AudioError(f"{what}: samples must be real numbers, got dtype {samples.dtype}")
    if np.issubdtype(samples.dtype, np.integer):
        if samples.dtype == np.uint8:  # 8-bit PCM is unsigned, centred on 128
            return (samples.astype(np.float32) - 128.0) / 128.0
        if samples.dtype not in INT_PCM_SCALE:
            raise AudioError(f"{what}: {samples.dtype} samples are ambiguous; pass float32 in [-1, 1] or "
                             f"int16 / int32 PCM")
        return (samples.astype(np.float64) / INT_PCM_SCALE[samples.dtype]).astype(np.float32)  # PCM full scale
    return samples.astype(np.float32, copy=False)


def array_mono(audio, sampling_rate, max_seconds: float | None, limit=bucket_limit) -> np.ndarray:
    """An audio array (numpy or torch, float or integer PCM, mono or a few channels) -> mono float32 at its own
    rate, checked: a plausible rate, not longer than max_seconds, not empty, finite."""
    what = "audio array"
    samples = _array_samples(audio, sampling_rate)
    _check_rate(sampling_rate, what)
    if samples.size:
        samples = _to_mono(samples, what)
        _check_duration(len(samples), sampling_rate, max_seconds, what, f"{len(samples)} samples at "
                        f"{sampling_rate} Hz", limit)
    if samples.size == 0:
        raise AudioError(f"{what}: audio is empty (0 samples)")
    if not np.isfinite(samples).all():
        raise AudioError(f"{what}: audio contains NaN or infinite samples")
    return samples


def load_audio(audio, sampling_rate: int | None = None, max_seconds: float | None = None,
               strict: bool = False) -> np.ndarray:
    """Path, encoded bytes (an upload: wav / flac / ogg / mp3) or array -> 16 kHz mono float32. Raises AudioError
    naming the problem.

    Integer PCM arrays are scaled to [-1, 1]. max_seconds (the largest audio bucket) is checked before decoding
    (file header) or resampling (arrays), so neither the decode nor the resampled output can grow past it. A file
    whose data chunk is shorter than its header says is transcribed with an AudioWarning, or refused (strict)."""
    if isinstance(audio, (str, Path)):
        what = str(audio)
        samples, sr = _read_file(Path(audio), sampling_rate, max_seconds, strict)
    elif isinstance(audio, (bytes, bytearray, memoryview)):
        what = "uploaded audio"
        if not len(audio):
            raise AudioError(f"{what}: the file is empty")
        samples, sr = _decode(lambda: io.BytesIO(audio), what, sampling_rate, max_seconds, strict)
    else:
        what, sr = "audio array", sampling_rate
        samples = array_mono(audio, sampling_rate, max_seconds)
    if sr != SAMPLE_RATE:
        import soxr
        samples = soxr.resample(samples, sr, SAMPLE_RATE, quality="HQ").astype(np.float32)
        if samples.size == 0:
            raise AudioError(f"{what}: too short: nothing is left after resampling {sr} Hz to {SAMPLE_RATE} Hz")
    return np.ascontiguousarray(samples, dtype=np.float32)


def check_language(language: str | None) -> None:
    """ConfigError now for a language mistral-common would refuse later (cheap: no model, no tokenizer)."""
    if language is None:
        return
    from mistral_common.protocol.transcription.request import TranscriptionRequest
    field = TranscriptionRequest.model_fields["language"]
    try:
        from pydantic import TypeAdapter
        TypeAdapter(field.annotation).validate_python(language)
    except Exception as e:
        raise ConfigError(f"invalid language {language!r} (expected an ISO-639-1 code such as en): "
                          f"{str(e).splitlines()[-1].strip()}") from None


@lru_cache(maxsize=4)
def mel_filters(n_mels: int) -> torch.Tensor:
    """[n_mels, n_fft//2 + 1] Slaney mel filter bank, 0-8 kHz (Whisper's)."""
    from mistral_common.audio import mel_filter_bank
    fb = mel_filter_bank(num_frequency_bins=1 + N_FFT // 2, num_mel_bins=n_mels, min_frequency=0.0,
                         max_frequency=8000.0, sampling_rate=SAMPLE_RATE)
    return torch.from_numpy(np.asarray(fb, dtype=np.float32)).T.contiguous()


def log_mel(samples: np.ndarray, n_mels: int, frames_per_chunk: int) -> torch.Tensor:
    """Padded 16 kHz samples -> [n_chunks, n_mels, frames_per_chunk]. The clamp to (max - 8) uses the max over
    the whole clip, as transformers' feature extractor does before splitting into chunks."""
    wave = torch.from_numpy(samples).float()
    stft = torch.stft(wave, N_FFT, HOP, window=torch.hann_window(N_FFT), return_complex=True)
    power = (stft[..., :-1].abs() ** 2).contiguous()
    spec = torch.clamp(mel_filters(n_mels) @ power, min=1e-10).log10()
    spec = (torch.maximum(spec, spec.max() - 8.0) + 4.0) / 4.0
    return spec.reshape(n_mels, -1, frames_per_chunk).transpose(0, 1).contiguous()


def build_prompt(tokenizer, samples: np.ndarray, language: str | None, n_mels: int, frames_per_chunk: int) -> Prompt:
    from mistral_common.protocol.transcription.request import TranscriptionRequest
    buf = io.BytesIO()
    sf.write(buf, samples, SAMPLE_RATE, format="WAV", subtype="FLOAT")  # lossless float32 round trip
    audio = buf.getvalue()
    if "RawAudio" in str(TranscriptionRequest.model_fields["audio"].annotation):  # mistral-common < 1.12
        from mistral_common.protocol.instruct.chunk import RawAudio
        audio = RawAudio(data=audio, format="wav")
    try:
        req = TranscriptionRequest(model="voxtral", audio=audio, language=language)
    except Exception as e:
        raise ConfigError(f"invalid transcription request (language={language!r}): {e}") from None
    enc = tokenizer.encode_transcription(req)
    padded = enc.audios[0].audio_array.astype(np.float32)
    return Prompt(input_ids=torch.tensor([enc.tokens], dtype=torch.long),
                  input_features=log_mel(padded, n_mels, frames_per_chunk),
                  duration_s=len(samples) / SAMPLE_RATE)


def decode(tokenizer, ids) -> str:
    return tokenizer.decode([int(i) for i in ids])
