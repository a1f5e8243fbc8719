import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nxdi_voxtral import Buckets, NxDVoxtralSpecDec  # noqa: E402
from nxdi_voxtral.config import AudioEncoderConfig, TextConfig, VoxtralConfig  # noqa: E402
from nxdi_voxtral.synthetic import TINY_AUDIO, write_random_checkpoint  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))

# tests/rehearsal run only in ../shared/neuron-rehearsal's venv (torch-xla + the real NxD source; `.ci/run` runs
# them there); elsewhere they are not collected, so they do not count as skipped
collect_ignore = []
try:
    import neuron_rehearsal  # noqa: F401
    import torch_xla  # noqa: F401
except ImportError:
    collect_ignore.append("rehearsal")
# tests/rehearsal_torchneuron run only in ../shared/torchneuron-rehearsal's venv (the real TorchNeuron backend source
# on torch 2.13 + torch-mlir; `.ci/run` runs them there)
if importlib.util.find_spec("torchneuron_rehearsal") is None:
    collect_ignore.append("rehearsal_torchneuron")
# tests/neuron are hardware tests for a trn2 host with the Neuron SDK (README, "verified where")
if importlib.util.find_spec("torch_neuronx") is None:
    collect_ignore.append("neuron")

SMALL_BUCKETS = Buckets(audio_chunks=(1, 2), kv_lengths=(512, 1024))

# decoder shapes: GQA 2:1 with head_dim != hidden/heads; MHA; GQA 8:1
TEXT_SHAPES = {
    "gqa2_hd32": TextConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=32),
    "mha_hd16": TextConfig(vocab_size=2048, hidden_size=64, intermediate_size=160, num_layers=3, num_heads=4,
                           num_kv_heads=4, head_dim=16),
    "gqa8_hd8": TextConfig(vocab_size=4096, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=8,
                           num_kv_heads=1, head_dim=8),
}


def make_cfg(shape: str = "gqa2_hd32", audio: AudioEncoderConfig = TINY_AUDIO) -> VoxtralConfig:
    return VoxtralConfig(audio=audio, text=TEXT_SHAPES[shape])


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory):
    cache = {}

    def make(shape="gqa2_hd32", seed=0, std=0.3, shards=1):
        key = (shape, seed, std, shards)
        if key not in cache:
            d = tmp_path_factory.mktemp(f"ckpt_{shape}_{seed}")
            cache[key] = write_random_checkpoint(d, make_cfg(shape), seed=seed, std=std, shards=shards)
        return cache[key]
    return make


@pytest.fixture(scope="session")
def tiny_dir(ckpt_factory):
    return ckpt_factory()


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    return NxDVoxtralSpecDec.from_pretrained(tiny_dir, buckets=SMALL_BUCKETS)


def noise(seconds: float, seed: int = 0, sr: int = 16000) -> np.ndarray:
    return (np.random.RandomState(seed).randn(int(seconds * sr)) * 0.1).astype(np.float32)


@pytest.fixture(scope="session")
def spec_dirs(tmp_path_factory):
    """A target whose layers 1 and 3 contribute little (high-acceptance layer draft [0, 2]), a random-layer draft
    (low acceptance) and a random DFlash draft capturing target layers [0, 2]."""
    from nxdi_voxtral.synthetic import (damp_dropped_layers, random_state_dict, write_checkpoint,
                                        write_layer_draft, write_random_dflash)
    root = tmp_path_factory.mktemp("spec")
    cfg = make_cfg("mha_hd16")  # 3 layers
    cfg = VoxtralConfig(audio=cfg.audio, text=TextConfig(**{**cfg.text.__dict__, "num_layers": 4}))
    target = write_checkpoint(root / "target", cfg, damp_dropped_layers(random_state_dict(cfg, 11), [0, 2], 0.05))
    return {
        "target": target,
        "layers_high": write_layer_draft(target, root / "draft_high", [0, 2]),
        "layers_low": write_layer_draft(target, root / "draft_low", [1]),
        "dflash": write_random_dflash(root / "dflash", cfg, target_layer_ids=(0, 2), num_layers=2, seed=5),
    }


@pytest.fixture(scope="session")
def spec_models(spec_dirs):
    d = spec_dirs
    return {
        "plain": NxDVoxtralSpecDec.from_pretrained(d["target"], buckets=SMALL_BUCKETS),
        "layers": NxDVoxtralSpecDec.from_pretrained(d["target"], draft=d["layers_high"], draft_kind="layers",
                                                    num_speculative_tokens=4, buckets=SMALL_BUCKETS),
        "dflash": NxDVoxtralSpecDec.from_pretrained(d["target"], draft=d["dflash"], draft_kind="dflash",
                                                    buckets=SMALL_BUCKETS),
        "ngram": NxDVoxtralSpecDec.from_pretrained(d["target"], draft_kind="ngram", num_speculative_tokens=3,
                                                   buckets=SMALL_BUCKETS),
    }
