"""NKI kernels vs their torch twins on a Neuron host (trn2): under nki.simulate, and on the device.

Run on a trn2 instance with the Neuron SDK (the `nki` package from AWS's Neuron pip repository):
    NEURON_PLATFORM_TARGET_OVERRIDE=trn2 python -m pytest -q tests/neuron/test_nki_device.py
Everything here is skipped where the real `nki` does not import (CPU hosts, the neuron-rehearsal stub); the
device tests also need /dev/neuron0 and either torch-xla (torch-neuronx, SDK <= 2.31) or TorchNeuron
(device "neuron", SDK >= 2.32). Shapes are Voxtral's: H = 3072, A = 375 per 30 s chunk, V_local = 32768 (tp 4)
and 131072 (tp 1), K+1 = 5 and 16.
"""
import os

import pytest
import torch

from nxdi_voxtral.kernels import ops
from nxdi_voxtral.kernels.rank_argmax import combine_rank_argmax, rank_argmax_kernel, rank_argmax_torch
from nxdi_voxtral.kernels.splice import splice_kernel, splice_torch
from nxdi_voxtral.kernels.verify import greedy_accept_kernel, greedy_accept_torch, greedy_verify_kernel, greedy_verify_torch

try:
    import nki as real_nki
    if getattr(real_nki, "IS_STUB", False) is True or not hasattr(real_nki, "jit"):
        raise ImportError("stub nki")
except Exception as e:  # noqa: BLE001
    pytest.skip(f"needs the Neuron SDK's `nki` package ({type(e).__name__}: {e})", allow_module_level=True)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def verify_inputs(b, k1, vocab, dtype, seed):
    logits = torch.randn(b, k1, vocab, generator=gen(seed)).to(dtype)
    logits[0, 0, [10, vocab - 1]] = 80.0  # a tie across segments: the first index must win
    target = torch.argmax(logits, -1).to(torch.int32)
    cand = torch.cat([torch.zeros(b, 1, dtype=torch.int32), target[:, :-1]], 1)
    if b > 1:
        cand[1, 2] += 1
    return cand, logits, torch.full((b,), k1 - 1, dtype=torch.int32)


def splice_inputs(chunks, dtype, seed):
    g = gen(seed)
    n_audio, t = 375 * chunks, 375 * chunks + 16
    embeds = torch.randn(t + 1, 3072, generator=g).to(dtype)
    audio = torch.randn(n_audio, 3072, generator=g).to(dtype)
    positions = (torch.arange(n_audio) + 4).to(torch.int32)
    positions[-3:] = t  # padding entries -> scratch row
    return embeds, audio, positions


# ----------------------------------------------------------------------------------------- nki.simulate
@pytest.fixture
def simulate(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    return lambda handle: real_nki.simulate(handle.real())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k1,vocab", [(5, 32768), (16, 32768), (16, 131072)])
def test_simulate_greedy_verify(simulate, dtype, k1, vocab):
    cand, logits, n_valid = verify_inputs(2, k1, vocab, dtype, seed=k1)
    got = simulate(greedy_verify_kernel)(cand, logits, n_valid)
    for g, w in zip(got, greedy_verify_torch(cand, logits, n_valid)):
        assert torch.equal(torch.as_tensor(g), w)
    acc, bonus = simulate(greedy_accept_kernel)(cand, got[0], n_valid)
    _, acc_t, bonus_t = greedy_accept_torch(cand, torch.as_tensor(got[0]), n_valid)
    assert torch.equal(torch.as_tensor(acc), acc_t) and torch.equal(torch.as_tensor(bonus), bonus_t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_simulate_rank_argmax_tp4(simulate, dtype):
    shard = 32768
    logits = torch.randn(16, 4 * shard, generator=gen(1)).to(dtype)
    logits[0, [shard + 5, 3 * shard + 5]] = 80.0
    vals, idx = [], []
    for r in range(4):
        v, i = simulate(rank_argmax_kernel)(logits[:, r * shard:(r + 1) * shard].contiguous())
        tv, ti = rank_argmax_torch(logits[:, r * shard:(r + 1) * shard])
        assert torch.equal(torch.as_tensor(v), tv) and torch.equal(torch.as_tensor(i), ti)
        vals.append(torch.as_tensor(v))
        idx.append(torch.as_tensor(i))
    assert torch.equal(combine_rank_argmax(torch.stack(vals), torch.stack(idx), shard),
                       torch.argmax(logits, -1).to(torch.int32))


@pytest.mark.parametrize("chunks", [1, 2])
def test_simulate_splice(simulate, chunks):
    embeds, audio, positions = splice_inputs(chunks, torch.bfloat16, seed=chunks)
    got = torch.as_tensor(simulate(splice_kernel)(embeds, audio, positions))
    t = embeds.shape[0] - 1
    assert torch.equal(got[:t], splice_torch(embeds, audio, positions)[:t])


# ------------------------------------------------------------------------------------------ on device
def _device():
    if not os.path.exists("/dev/neuron0"):
        pytest.skip("no Neuron device (/dev/neuron0)")
    try:
        import torch_xla.core.xla_model as xm
        return xm.xla_device()
    except Exception:
        pass
    try:
        return torch.device("neuron")
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"neither torch-xla nor TorchNeuron: {e}")


@pytest.fixture
def device(monkeypatch):
    monkeypatch.setenv(ops.ENV, "nki")
    return _device()


def _cpu(x):
    return tuple(t.cpu() for t in x) if isinstance(x, tuple) else x.cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k1", [5, 16])
def test_device_greedy_verify(device, dtype, k1):
    cand, logits, n_valid = verify_inputs(1, k1, 32768, dtype, seed=3)
    got = _cpu(ops.greedy_verify(cand.to(device), logits.to(device), n_valid.to(device)))
    for g, w in zip(got, greedy_verify_torch(cand, logits, n_valid)):
        assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_rank_argmax(device, dtype):
    logits = torch.randn(1, 16, 32768, generator=gen(4)).to(dtype)
    v, i = _cpu(ops.rank_argmax(logits.to(device)))
    tv, ti = rank_argmax_torch(logits)
    assert torch.equal(v, tv) and torch.equal(i, ti)


def test_device_splice(device):
    embeds, audio, positions = splice_inputs(1, torch.bfloat16, seed=5)
    got = _cpu(ops.splice(embeds.to(device), audio.to(device), positions.to(device)))
    t = embeds.shape[0] - 1
    assert torch.equal(got[:t], splice_torch(embeds, audio, positions)[:t])
