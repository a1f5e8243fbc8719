"""kernels/nki_interp.py: every documented NKI rule it enforces fails a small kernel that breaks it, with an error
naming the rule; plus the runtime semantics the kernels rely on (garbage fill, find_index8, casts, OOB)."""
import sys

import numpy as np
import pytest
import torch

from nxdi_voxtral.kernels import nki_api, nki_interp
from nxdi_voxtral.kernels.nki_api import nisa, nki, nl
from nxdi_voxtral.kernels.nki_interp import NkiRuleError, NkiRuntimeError

I = nki_interp  # its nl / nisa: arguments built outside kernels (the lazy `nl` would import the SDK)

F32 = np.float32


def run(kernel, *args, **kw):
    return nki_interp.simulate(kernel)(*args, **kw)


def x(shape, dtype=F32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# --------------------------------------------------------------------------------------- partition dim
@nki.jit
def too_many_partitions(a):
    t = nl.ndarray((129, 4), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)
    out = nl.ndarray((129, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_partition_dim_at_most_128():
    with pytest.raises(NkiRuleError, match=r"partition dim 129 > 128"):
        run(too_many_partitions, x((129, 4)))


@nki.jit
def copy_rows(a, start, stop):
    t = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)
    u = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=u, value=0.0)
    nisa.tensor_copy(dst=u[start:stop, :], src=t[start:stop, :])
    out = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=u)
    return out


@pytest.mark.parametrize("start,stop,ok", [(0, 128, True), (32, 64, True), (96, 128, True), (64, 128, True),
                                           (5, 10, False), (32, 96, False), (16, 48, False), (1, 128, False)])
def test_partition_start_rules(start, stop, ok):
    a = x((128, 4))
    if ok:
        out = run(copy_rows, a, start, stop)
        assert np.array_equal(out[start:stop], a[start:stop])
    else:
        with pytest.raises(NkiRuleError, match="starts at partition"):
            run(copy_rows, a, start, stop)


# ------------------------------------------------------------------------------------------- dst first
@nki.jit
def legacy_reduce(a):
    t = nl.ndarray((4, 16), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)
    m = nisa.tensor_reduce(nl.maximum, t, 1)  # NKI <= 0.1 style: returns the tile
    out = nl.ndarray((4, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=m)
    return out


@nki.jit
def legacy_max8(a):
    t = nl.ndarray((4, 16), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)
    return nisa.max8(src=t)


def test_dst_first():
    with pytest.raises(NkiRuleError, match="destination tensor first"):
        run(legacy_reduce, x((4, 16)))
    with pytest.raises(NkiRuleError, match="destination tensor first"):
        run(legacy_max8, x((4, 16)))


# ------------------------------------------------------------------------------------------ reductions
@nki.jit
def reduce_axis(a, axis, dshape):
    t = nl.ndarray((4, 2, 8), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)
    r = nl.ndarray(dshape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=r, op=nl.maximum, data=t, axis=axis)
    out = nl.ndarray(dshape, dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=r)
    return out


def test_reductions_only_on_trailing_free_axes():
    a = x((4, 2, 8))
    assert np.array_equal(run(reduce_axis, a, (1, 2), (4, 1)), a.max(axis=(1, 2))[:, None])
    assert np.array_equal(run(reduce_axis, a, 2, (4, 2)), a.max(axis=2))
    with pytest.raises(NkiRuleError, match="partition dim"):
        run(reduce_axis, a, 0, (1, 2))
    with pytest.raises(NkiRuleError, match="trailing contiguous"):
        run(reduce_axis, a, (1,), (4, 8))


# ----------------------------------------------------------------------------------------- index tiles
@nki.jit
def gather_rows(data, idx, idx_buffer, idx_cols):
    p = idx.shape[0]
    i = nl.ndarray((p, idx_cols), dtype=idx.dtype, buffer=idx_buffer)
    nisa.dma_copy(dst=i, src=idx)
    rows = nl.ndarray((p, data.shape[1]), dtype=data.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=rows, src=data.ap(pattern=[[data.shape[1], p], [1, data.shape[1]]], vector_offset=i,
                                        indirect_dim=0))
    out = nl.ndarray((p, data.shape[1]), dtype=data.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=rows)
    return out


def test_index_tiles_are_p_by_1_in_sbuf():
    data, idx = x((10, 6)), np.array([[3], [0], [9]], dtype=np.int32)
    assert np.array_equal(run(gather_rows, data, idx, I.nl.sbuf, 1), data[[3, 0, 9]])
    with pytest.raises(NkiRuleError, match=r"\(P, 1\)"):
        run(gather_rows, data, idx, I.nl.hbm, 1)
    with pytest.raises(NkiRuleError, match=r"\(P, 1\)"):
        run(gather_rows, data, np.array([[3, 0], [9, 1]], dtype=np.int32), I.nl.sbuf, 2)
    with pytest.raises(NkiRuleError, match="int32/uint32"):
        run(gather_rows, data, idx.astype(np.float32), I.nl.sbuf, 1)


# ------------------------------------------------------------------------------------- max8 free sizes
@nki.jit
def top8(a, find):
    p, n = a.shape
    t = nl.ndarray((p, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)
    m = nl.ndarray((p, 8), dtype=nl.float32, buffer=nl.sbuf)
    i = nl.ndarray((p, 8), dtype=nl.uint32, buffer=nl.sbuf)
    if find:
        nisa.memset(dst=m, value=0.0)
        nisa.nc_find_index8(dst=i, data=t, vals=m)
    else:
        nisa.max8(dst=m, src=t)
    out = nl.ndarray((p, 8), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=m)
    return out


@pytest.mark.parametrize("n,ok", [(8, True), (16384, True), (7, False), (16385, False)])
def test_max8_and_find_index8_free_size(n, ok):
    a = x((2, n))
    for find in (False, True):
        if ok:
            out = run(top8, a, find)
            if not find:
                assert np.array_equal(out, -np.sort(-a, axis=1)[:, :8])
        else:
            with pytest.raises(NkiRuleError, match="8..16384"):
                run(top8, a, find)


# ------------------------------------------------------------------------------------ outputs, PSUM DMA
@nki.jit
def output_in(a, buffer):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=buffer)
    nisa.dma_copy(dst=out, src=a)
    return out


def test_outputs_in_shared_hbm():
    a = x((4, 4))
    assert np.array_equal(run(output_in, a, I.nl.shared_hbm), a)
    for buf in (I.nl.hbm, I.nl.sbuf):
        with pytest.raises(NkiRuleError, match="shared_hbm"):
            run(output_in, a, buf)


@nki.jit
def dma_from_psum(a):
    t = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)
    ps = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum)
    nisa.tensor_copy(dst=ps, src=t)
    out = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=ps)
    return out


def test_no_dma_from_psum():
    with pytest.raises(NkiRuleError, match="PSUM"):
        run(dma_from_psum, x((4, 4)))


# ------------------------------------------------------------------------------------ operand rules
@nki.jit
def scalar_op(a, operand, value):
    t = nl.ndarray((4, 4), dtype=nl.int32, buffer=nl.sbuf)
    nisa.memset(dst=t, value=value)
    u = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=u, data=t, op0=nl.add, operand0=operand)
    out = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=u)
    return out


@nki.jit
def compute_on_hbm(a):
    out = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.tensor_copy(dst=out, src=a)
    return out


def test_operand_rules():
    assert np.array_equal(run(scalar_op, x((1, 1)), 1.5, 2), np.full((4, 4), 3.5, F32))
    with pytest.raises(NkiRuleError, match="float32"):
        run(scalar_op, x((1, 1)), 1, 2)          # int operand
    with pytest.raises(NkiRuleError, match="must be an int"):
        run(scalar_op, x((1, 1)), 1.5, 2.0)      # float memset value for an int32 tile
    with pytest.raises(NkiRuleError, match="SBUF/PSUM only"):
        run(compute_on_hbm, x((4, 4)))
    with pytest.raises(NkiRuleError, match="no int64"):
        run(output_in, np.zeros((2, 2), dtype=np.int64), I.nl.shared_hbm)
    with pytest.raises(NkiRuleError, match="lists"):
        run(output_in, x((2, 2)), [I.nl.shared_hbm])


# ----------------------------------------------------------------------------------- runtime semantics
@nki.jit
def read_unwritten(a):
    t = nl.ndarray((2, 4), dtype=a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t[:, 0:2], src=a)
    out = nl.ndarray((2, 4), dtype=a.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_fresh_tensors_hold_garbage():
    f = run(read_unwritten, np.ones((2, 2), F32))
    assert np.all(f[:, :2] == 1) and np.all(np.isnan(f[:, 2:]))
    i = run(read_unwritten, np.ones((2, 2), np.int32))
    assert np.all(i[:, 2:].view(np.uint32) == 0xDEADBEEF)


@nki.jit
def find8(data, vals):
    p, n = data.shape
    d = nl.ndarray((p, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=d, src=data)
    v = nl.ndarray((p, 8), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=v, src=vals)
    i = nl.ndarray((p, 8), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.nc_find_index8(dst=i, data=d, vals=v)
    out = nl.ndarray((p, 8), dtype=nl.uint32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=i)
    return out


def test_find_index8_first_occurrence_duplicates_and_missing():
    data = np.array([[1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8]], F32)
    vals = np.array([[3, 8, 8, 8, 5, 8, 1, 8]], F32)
    none = 0xFFFFFFFF
    assert run(find8, data, vals).tolist() == [[2, 4, 5, 6, none, 7, 0, 8]]


@nki.jit
def cast(a, dtype):
    t = nl.ndarray(a.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)
    u = nl.ndarray(a.shape, dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=u, src=t)
    out = nl.ndarray(a.shape, dtype=dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=u)
    return out


def test_casts_round_to_nearest_even():
    a = torch.tensor([[1.0, 1.00390625, 1.01171875, 3.4e38, -2.5, 0.5, 1.5, 2.5]])  # bf16 ties, overflow
    got = run(cast, a, I.nl.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, a.to(torch.bfloat16))
    i = run(cast, np.array([[0.5, 1.5, 2.5, -2.5, 3e9, -3e9, np.nan, 7.49]], F32), I.nl.int32)
    assert i.tolist() == [[0, 2, 2, -2, 2**31 - 1, -2**31, 0, 7]]


@nki.jit
def scatter_rows(table, idx, rows, mode):
    p, h = rows.shape
    out = nl.ndarray(table.shape, dtype=table.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=table)
    i = nl.ndarray((p, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=i, src=idx)
    r = nl.ndarray((p, h), dtype=rows.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=r, src=rows)
    nisa.dma_copy(dst=out.ap(pattern=[[h, p], [1, h]], vector_offset=i, indirect_dim=0), src=r, oob_mode=mode)
    return out


def test_indirect_dma_out_of_bounds_and_duplicates():
    table, rows = np.zeros((5, 3), F32), x((3, 3))
    idx = np.array([[4], [5], [0]], np.int32)
    with pytest.raises(NkiRuntimeError, match="out of bounds"):
        run(scatter_rows, table, idx, rows, I.nisa.oob_mode.error)
    out = run(scatter_rows, table, idx, rows, I.nisa.oob_mode.skip)
    assert np.array_equal(out[4], rows[0]) and np.array_equal(out[0], rows[2]) and not out[1:4].any()
    out = run(scatter_rows, table, np.array([[2], [2], [1]], np.int32), rows, I.nisa.oob_mode.error)
    assert np.all(np.isnan(out[2])) and np.array_equal(out[1], rows[2])  # write order undefined -> garbage


def test_interpreter_leaves_modules_alone():
    run(output_in, x((2, 2)), I.nl.shared_hbm)
    assert globals()["nl"] is nki_api.nl and globals()["nisa"] is nki_api.nisa  # this module still lazy
    assert not isinstance(sys.modules.get("nki"), type(nki_interp.nki))
    with pytest.raises(AttributeError, match="not in the NKI subset"):
        nki_interp.nisa.nc_matmul
