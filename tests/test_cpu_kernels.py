"""nxdi_voxtral::row_linear (csrc/row_linear.c) against its torch twin and a float64 reference: row-invariant for
every row count, any shape (feature and k tails), any thread count; the torch twin serves where the kernel can't."""
import logging
import shutil
from pathlib import Path

import pytest
import torch

from nxdi_voxtral import cpu_kernels, tp
from nxdi_voxtral.cpu_kernels import ROW_INVARIANT_ROWS, row_linear, torch_row_linear

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
