"""Audio in, prompt ids and log-mel features out; token ids back to text.

Audio -> 16 kHz mono float32 -> mistral-common TranscriptionRequest (pads to 30 s chunks and builds the prompt
[BOS][INST][BEGIN_AUDIO][AUDIO]*n[/INST] lang:xx [TRANSCRIBE]) -> Whisper log-mel (the features transformers'
Voxtral processor computes) split into 30 s chunks.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from .errors import AudioError, CheckpointError, ConfigError

SAMPLE_RATE = 16000
N_FFT, HOP = 400, 160


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


def _to_mono(samples: np.ndarray, what: str) -> np.ndarray:
    if samples.ndim == 1:
        return samples
    if samples.ndim == 2:
        # soundfile's layout is (frames, channels); also accept (channels, frames) for a handful of channels
        if samples.shape[1] <= 8 and samples.shape[1] <= samples.shape[0]:
            return samples.mean(axis=1)
        if samples.shape[0] <= 8:
            return samples.mean(axis=0)
    raise AudioError(f"{what}: expected mono [samples] or multi-channel [samples, channels] audio, "
                     f"got an array of shape {samples.shape}")


def load_audio(audio, sampling_rate: int | None = None) -> np.ndarray:
    """Path or array -> 16 kHz mono float32. Raises AudioError naming the problem."""
    if isinstance(audio, (str, Path)):
        what = str(audio)
        if not Path(audio).is_file():
            raise AudioError(f"{what}: no such audio file")
        try:
            samples, sr = sf.read(str(audio), dtype="float32", always_2d=True)
        except Exception as e:
            raise AudioError(f"{what}: cannot decode as audio ({type(e).__name__}: {e})") from None
        if sampling_rate is not None and sampling_rate != sr:
            raise AudioError(f"{what}: file is {sr} Hz but sampling_rate={sampling_rate} was given")
    else:
        what = "audio array"
        if sampling_rate is None:
            raise AudioError("an audio array needs its sampling_rate")
        sr = sampling_rate
        samples = audio.numpy() if isinstance(audio, torch.Tensor) else np.asarray(audio)
        if not np.issubdtype(samples.dtype, np.number):
            raise AudioError(f"{what}: samples must be numbers, got dtype {samples.dtype}")
        samples = samples.astype(np.float32, copy=False)
    if not isinstance(sr, (int, np.integer)) or sr <= 0:
        raise AudioError(f"{what}: invalid sampling rate {sr!r}")
    if samples.size == 0:
        raise AudioError(f"{what}: audio is empty (0 samples)")
    samples = _to_mono(samples, what)
    if not np.isfinite(samples).all():
        raise AudioError(f"{what}: audio contains NaN or infinite samples")
    if sr != SAMPLE_RATE:
        import soxr
        samples = soxr.resample(samples, sr, SAMPLE_RATE, quality="HQ").astype(np.float32)
    return np.ascontiguousarray(samples, dtype=np.float32)


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
