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
