"""Bad inputs get typed errors that name the file and the problem (issue 13, items 4, 5 and the should-fix list):
broken checkpoints, hostile audio headers, API arguments of the wrong kind, and CLI arguments refused before the
model loads."""
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from nxdi_voxtral import (AudioError, AudioTooLongError, Buckets, CheckpointError, ConfigError, NxDVoxtralSpecDec)
from nxdi_voxtral.__main__ import main as cli_main
from nxdi_voxtral.checkpoint import read_safetensors
from nxdi_voxtral.config import VoxtralConfig
from nxdi_voxtral.dflash import DFlashConfig
from nxdi_voxtral.errors import ArtifactError
from nxdi_voxtral.processing import AudioWarning, load_audio

from conftest import make_cfg, noise

B = Buckets(audio_chunks=(1,), kv_lengths=(512,))


# ---------------------------------------------------------------- checkpoints

@pytest.mark.parametrize("text,match", [
    ("[1, 2]", "config.json: expected a JSON object, got list"),
    ("null", "config.json: expected a JSON object, got NoneType"),
    ('{"text_config": {"hidden_size": "64"}}', r"config.json: text_config.hidden_size must be an integer, got str"),
    ('{"text_config": [1]}', "config.json: text_config must be an object"),
])
def test_bad_config_json_is_named(tmp_path, text, match):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=match):
        VoxtralConfig.from_dir(tmp_path)


@pytest.mark.parametrize("index,match", [("{not json", "index.json: not valid JSON"),
                                         ('{"metadata": {}}', "index.json: no weight_map"),
                                         ("[]", "index.json: expected a JSON object")])
def test_bad_shard_index_is_named(tmp_path, index, match):
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match=match):
        read_safetensors(tmp_path)


def edited_checkpoint(tmp_path, edit):
    from nxdi_voxtral.synthetic import random_state_dict, write_checkpoint
    cfg = make_cfg()
    sd = random_state_dict(cfg, 0)
    edit(sd)
    return write_checkpoint(tmp_path / "ckpt", cfg, sd)


KEY = "language_model.model.layers.1.mlp.up_proj.weight"  # the hub file's name for it


@pytest.mark.parametrize("edit,match", [
    (lambda sd: sd.__setitem__(KEY, sd[KEY].to(torch.int32)), f"'{KEY}' has dtype torch.int32, expected floating"),
    (lambda sd: sd[KEY].__setitem__((0, 0), float("nan")), f"'{KEY}' contains NaN or infinite values"),
    (lambda sd: sd.__setitem__(KEY + "_renamed", sd.pop(KEY)), f"tensor '{KEY}' is missing"),
])
def test_bad_weights_are_named_by_the_checkpoint_key(tmp_path, edit, match):
    d = edited_checkpoint(tmp_path, edit)
    with pytest.raises(CheckpointError, match=match):
        NxDVoxtralSpecDec.from_pretrained(d, buckets=B)


def test_dflash_config_errors_name_the_file(tmp_path, tiny_dir):
    from nxdi_voxtral.synthetic import write_random_dflash
    dflash = write_random_dflash(tmp_path / "dflash", make_cfg(), target_layer_ids=(0, 1), num_layers=1, seed=0)
    with pytest.raises(CheckpointError, match=rf"{dflash}/config.json: no text_config.*draft_kind='dflash'"):
        NxDVoxtralSpecDec.from_pretrained(tiny_dir, draft=dflash, draft_kind="layers", buckets=B)
    (dflash / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        DFlashConfig.from_dir(dflash)


def test_damaged_program_without_hash_check_is_an_artifact_error(tmp_path):
    from torch import nn
    from nxdi_voxtral.export import Program, export_graph
    path = tmp_path / "lin.pt2"
    export_graph("lin", nn.Linear(2, 2), (torch.randn(1, 2),), path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # what verify_hashes=False lets through (today: a UnicodeDecodeError)
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="lin.pt2: cannot load the exported program"):
        Program(path, nn.Linear(2, 2), ["weight", "bias"])


# ---------------------------------------------------------------- audio

def wav_with_header(path: Path, rate: int, n_samples: int) -> Path:
    sf.write(path, np.zeros(n_samples, np.int16), 16000, subtype="PCM_16")
    data = bytearray(path.read_bytes())
    struct.pack_into("<II", data, 24, rate, rate * 2)  # sample rate and byte rate of the fmt chunk
    path.write_bytes(bytes(data))
    return path


def test_absurd_sample_rates_are_refused_before_decoding(tmp_path):
    with pytest.raises(AudioError, match="sample rate 1 Hz is outside"):
        load_audio(wav_with_header(tmp_path / "1hz.wav", 1, 32000), max_seconds=30)  # today: 21 GB, 54 s
    with pytest.raises(AudioError, match="sample rate 1000000000 Hz is outside"):
        load_audio(wav_with_header(tmp_path / "1ghz.wav", 10 ** 9, 4))
    with pytest.raises(AudioError, match="nothing is left after resampling"):
        load_audio(np.ones(4, np.float32), sampling_rate=384000)  # today: torch.stft on 0 samples


def test_long_file_refused_from_its_header(tmp_path, monkeypatch):
    path = tmp_path / "hour.wav"
    sf.write(path, np.zeros(16, np.int16), 16000, subtype="PCM_16")
    n_bytes = 3600 * 16000 * 2  # one hour at 16 kHz: a sparse file, no disk or time spent
    data = bytearray(path.read_bytes()[:44])
    struct.pack_into("<I", data, 4, 36 + n_bytes)
    struct.pack_into("<I", data, 40, n_bytes)
    with open(path, "wb") as f:
        f.write(bytes(data))
        f.truncate(44 + n_bytes)

    def no_decoding(*a, **k):
        raise AssertionError("decoded before the duration check")
    monkeypatch.setattr(sf, "read", no_decoding)
    monkeypatch.setattr(sf.SoundFile, "read", no_decoding)
    monkeypatch.setattr(sf.SoundFile, "blocks", no_decoding)
    too_long = r"3600.0 s of audio \(from the file header\) is too long: the largest audio bucket holds 1 \(30 s\)"
    with pytest.raises(AudioTooLongError, match=too_long):
        load_audio(path, max_seconds=30)


def test_truncated_file_warns_or_is_refused_with_strict(tmp_path, tiny_model):
    full = tmp_path / "full.wav"
    sf.write(full, noise(1.0), 16000, subtype="PCM_16")
    cut = tmp_path / "cut.wav"
    cut.write_bytes(full.read_bytes()[:16000])
    with pytest.warns(AudioWarning, match="truncated file: the header announces 32000 bytes"):
        samples = load_audio(cut)
    assert 7900 < len(samples) < 8000
    with pytest.raises(AudioError, match="truncated"):
        tiny_model.prepare(cut, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_audio(full)  # an intact file: no warning


def test_audio_path_messages_and_many_channels(tmp_path):
    with pytest.raises(AudioError, match="is a directory"):
        load_audio(tmp_path)
    ten = np.random.RandomState(0).randn(4000, 10).astype(np.float32) * 0.1
    sf.write(tmp_path / "ten.wav", ten, 16000, subtype="FLOAT")
    np.testing.assert_allclose(load_audio(tmp_path / "ten.wav"), ten.mean(axis=1), rtol=1e-5, atol=1e-7)


def test_integer_pcm_arrays_are_scaled(tmp_path):
    x = noise(0.5)
    pcm = np.round(x * 32767).astype(np.int16)
    np.testing.assert_allclose(load_audio(pcm, 16000), pcm / 32768.0, rtol=1e-6)
    assert np.abs(load_audio(pcm, 16000)).max() < 1.0
    with pytest.raises(AudioError, match="int64 samples are ambiguous"):
        load_audio(pcm.astype(np.int64), 16000)


# ---------------------------------------------------------------- API arguments

def test_generate_input_kinds(tiny_model):
    m = tiny_model
    p = m.prepare(noise(1.0, seed=3), sampling_rate=16000)
    ref = m.generate(p.input_ids, p.input_features, max_new_tokens=4)
    assert torch.equal(m.generate(p.input_ids[0].tolist(), p.input_features, max_new_tokens=4), ref)
    assert torch.equal(m.generate(p.input_ids.numpy(), p.input_features.numpy(), max_new_tokens=4), ref)
    bad = p.input_ids.clone()
    bad[0, -1] = m.cfg.text.vocab_size + 5
    with pytest.raises(ConfigError, match=rf"token id {m.cfg.text.vocab_size + 5}, outside the vocabulary"):
        m.generate(bad, p.input_features, max_new_tokens=4)
    nan = p.input_features.clone()
    nan[0, 0, 0] = float("nan")
    with pytest.raises(ConfigError, match="input_features contains NaN"):
        m.generate(p.input_ids, nan, max_new_tokens=4)


def test_speculation_room_is_reported_as_such(tiny_dir):
    m = NxDVoxtralSpecDec.from_pretrained(tiny_dir, draft_kind="ngram", num_speculative_tokens=120, buckets=B)
    p = m.prepare(noise(1.0), sampling_rate=16000)
    n = m.setup.token_room(p.input_ids.shape[1]) + 1  # would fit without the speculation room
    assert n > 0
    with pytest.raises(ConfigError, match=rf"max_new_tokens \({n}\) \+ speculation room \(K=120\)"):
        m.generate(p.input_ids, p.input_features, max_new_tokens=n)
    with pytest.raises(ConfigError, match="ngram.*no draft checkpoint"):
        NxDVoxtralSpecDec.from_pretrained(tiny_dir, draft=tiny_dir, draft_kind="ngram", buckets=B)


# ---------------------------------------------------------------- CLI: cheap checks before the model loads

@pytest.mark.parametrize("args,match", [
    (["missing.wav"], "AudioError: missing.wav: no such audio file"),
    (["examples"], "AudioError: examples: is a directory"),
    (["examples/chirp.wav", "--language", "english"], "ConfigError: invalid language 'english'"),
    (["examples/chirp.wav", "--max-new-tokens", "0"], "ConfigError: --max-new-tokens must be a positive"),
    (["examples/chirp.wav", "--draft-kind", "ngram", "-k", "0"], "ConfigError: -k / --num-speculative-tokens"),
    (["examples/chirp.wav", "--draft", "d", "--draft-kind", "ngram"], "ConfigError: --draft-kind ngram uses no"),
    (["examples/chirp.wav", "-k", "4"], "ConfigError: -k / --num-speculative-tokens 4 needs a draft"),
])
def test_cli_refuses_cheap_arguments_before_loading(args, match, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    # a model dir that does not exist: any load attempt would report a CheckpointError instead
    assert cli_main(["transcribe", *args, "--model", str(tmp_path / "no-model")]) == 2
    assert match in capsys.readouterr().err


def test_cli_uncreatable_cache_is_a_config_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("NXDI_VOXTRAL_CACHE", str(blocker / "cache"))
    assert cli_main(["transcribe", "examples/chirp.wav"]) == 2
    err = capsys.readouterr().err
    assert "ConfigError: cannot create the demo model cache" in err and str(blocker / "cache") in err
