"""The CPU decode/verify ops (csrc/decode_kernels.c) against their torch twins and float64 references: row-invariant
for every row count, any shape (tails), any thread count; the torch twins serve where the kernels can't."""
import logging
import shutil
from pathlib import Path

import pytest
import torch

from nxdi_voxtral import cpu_kernels, tp
from nxdi_voxtral.cpu_kernels import (ROW_INVARIANT_ROWS, decode_attention, row_linear, torch_decode_attention,
                                      torch_row_linear)

HOST_HAS_AVX512_BF16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False
SHAPES = [(37, 53), (64, 3072), (130, 1000), (8, 31), (1, 17), (24, 64)]  # (out, in): tails in both


def test_kernel_builds_on_this_host():
    if HOST_HAS_AVX512_BF16 and (shutil.which("cc") or shutil.which("gcc")):
        assert cpu_kernels.kernel_library() is not None
    else:
        assert cpu_kernels.kernel_library() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", [row_linear, torch_row_linear], ids=["op", "torch_twin"])
def test_rows_are_invariant_and_accurate(dtype, impl):
    gen = torch.Generator().manual_seed(0)
    for out_f, in_f in SHAPES:
        w = torch.randn(out_f, in_f, generator=gen).to(dtype)
        x = torch.randn(ROW_INVARIANT_ROWS, in_f, generator=gen).to(dtype)
        full = impl(x, w)
        assert full.dtype == dtype and full.shape == (ROW_INVARIANT_ROWS, out_f)
        for rows in range(1, ROW_INVARIANT_ROWS + 1):
            assert torch.equal(impl(x[:rows], w), full[:rows]), (out_f, in_f, rows)
        for r in range(ROW_INVARIANT_ROWS):  # a row alone (the decode step) and in any position of a block
            assert torch.equal(impl(x[r:r + 1], w)[0], full[r])
            assert torch.equal(impl(x[[(r - 1) % ROW_INVARIANT_ROWS, r, (r + 5) % ROW_INVARIANT_ROWS]], w)[1], full[r])
        ref = x.double() @ w.double().T
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert ((full.double() - ref).abs().max() / ref.abs().max()).item() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thread_count_does_not_change_bits(dtype):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(4096 + 3, 256, generator=gen).to(dtype)  # large enough to use the thread pool
    x = torch.randn(5, 256, generator=gen).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = row_linear(x, w)
        torch.set_num_threads(2)
        two = row_linear(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def reference_attention(q, k, v, visible):
    """float64, k/v repeated per query head"""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    out = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v  # [1, Hq, T, D]
    return out[0].transpose(0, 1)


ATTENTION_SHAPES = [(16, 4, 64, 512), (32, 8, 128, 300), (4, 4, 32, 96), (6, 2, 8, 37), (2, 1, 20, 17)]  # Hq,Hkv,D,S


def one_sequence(impl):
    """impl on one sequence whose keys start at row 0 of k / v."""
    return lambda q, k, v, visible: impl(q, k, v, visible[None], torch.zeros(1, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", [decode_attention, torch_decode_attention], ids=["op", "torch_twin"])
def test_attention_rows_are_invariant_and_accurate(dtype, op):
    gen = torch.Generator().manual_seed(3)
    impl = one_sequence(op)
    t = 16
    for hq, hkv, d, s in ATTENTION_SHAPES:
        q = torch.randn(1, hq, t, d, generator=gen).to(dtype)
        k_cache, v_cache = (torch.randn(1, hkv, s + 40, d, generator=gen).to(dtype) for _ in range(2))
        k, v = k_cache[:, :, :s], v_cache[:, :, :s]  # a KV bucket of a longer cache: heads strided
        visible = torch.rand(t, s, generator=gen) > 0.4
        visible[:, 0] = True
        full = impl(q, k, v, visible)
        assert full.shape == (t, hq, d) and full.dtype == dtype
        for rows in (1, 2, 5, 9, t):
            assert torch.equal(impl(q[:, :, :rows], k, v, visible[:rows]), full[:rows]), (hq, d, s, rows)
        for r in range(t):
            assert torch.equal(impl(q[:, :, r:r + 1], k, v, visible[r:r + 1])[0], full[r])
        ref = reference_attention(q, k, v, visible)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (full.double() - ref).abs().max().item() < tol * ref.abs().max().item()


def test_attention_row_that_sees_nothing_is_zero_and_masked_keys_are_ignored():
    q, k, v = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
    visible = torch.zeros(2, 10, dtype=torch.bool)
    visible[1, :3] = True
    attend = one_sequence(decode_attention)
    out = attend(q, k, v, visible)
    assert torch.equal(out[0], torch.zeros(4, 16))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 3:], v2[:, :, 3:] = float("nan"), 1e30
    assert torch.equal(attend(q, k2, v2, visible)[1], out[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", [decode_attention, torch_decode_attention], ids=["op", "torch_twin"])
def test_attention_batch_reads_each_sequences_slot(dtype, op):
    """b sequences in one call, each reading its own slot of one cache: every row equals the row computed alone,
    whatever the other sequences, their slots or the key length S beyond what the row sees."""
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, slot_len, b, t = 8, 2, 32, 64, 4, 3
    store = [torch.randn(1, hkv, 6 * slot_len, d, generator=gen).to(dtype) for _ in range(2)]
    q = torch.randn(b, hq, t, d, generator=gen).to(dtype)
    slots = torch.tensor([5, 0, 3, 1])
    lengths = torch.tensor([10, 40, 3, 33])
    outs = []
    for s in (48, 64):
        visible = torch.arange(s)[None, None, :] < (lengths[:, None, None] + torch.arange(t)[None, :, None])
        out = op(q, *store, visible, slots * slot_len).view(b, t, hq, d)
        for i in range(b):
            alone = op(q[i:i + 1], *store, visible[i:i + 1], slots[i:i + 1] * slot_len)
            assert torch.equal(out[i], alone.view(t, hq, d)), (s, i)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])  # a longer key bucket changes no bit


def test_linear_strided_input_and_bias():
    gen = torch.Generator().manual_seed(2)
    w, b = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    x = torch.randn(1, 24, 6, generator=gen).transpose(1, 2)  # [1, 6, 24], not contiguous
    y = tp.linear(x, w, b)
    assert y.shape == (1, 6, 40)
    assert torch.allclose(y, torch.nn.functional.linear(x, w, b), atol=1e-5)
    assert torch.equal(y[0, 2], tp.linear(x[:, 2:3].contiguous(), w, b)[0, 0])


def test_torch_twin_serves_without_a_compiler(monkeypatch, caplog):
    cpu_kernels.kernel_library.cache_clear()
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: None)
    try:
        with caplog.at_level(logging.WARNING, logger="nxdi_voxtral.cpu_kernels"):
            assert cpu_kernels.kernel_library() is None
        assert "no C compiler" in caplog.text
        w, x = torch.randn(8, 16), torch.randn(3, 16)
        assert torch.equal(row_linear(x, w), torch_row_linear(x, w))
    finally:
        cpu_kernels.kernel_library.cache_clear()


def test_broken_compiler_falls_back_with_a_reason(monkeypatch, tmp_path, caplog):
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho 'cc: error: unrecognized option -mavx512bf16' >&2\nexit 1\n")
    cc.chmod(0o755)
    cpu_kernels.kernel_library.cache_clear()
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    try:
        with caplog.at_level(logging.WARNING, logger="nxdi_voxtral.cpu_kernels"):
            assert cpu_kernels.kernel_library() is None
        assert "unrecognized option -mavx512bf16" in caplog.text
    finally:
        cpu_kernels.kernel_library.cache_clear()


def test_export_holds_one_op_node():
    class Proj(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = tp.Linear(32, 48)

        def forward(self, x):
            return self.proj(x)

    m, x = Proj().eval(), torch.randn(1, 5, 32)
    ep = torch.export.export(m, (x,))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert "nxdi_voxtral.row_linear.default" in targets
    assert torch.equal(ep.module()(x), m(x))
