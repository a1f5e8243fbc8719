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


# ------------------------------------------------------------------------------- every rule, one kernel each
# Each kernel below takes `bad` last: False runs a correct kernel, True breaks exactly one rule. Helpers reached
# through this module's globals are rebound with the kernel (kernels.nki_api.rebind), so they may use nl / nisa.
def sb(shape, dtype=None, buffer=None):
    return nl.ndarray(shape, dtype=dtype or nl.float32, buffer=buffer or nl.sbuf)


def load(a, buffer=None):
    t = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)
    if buffer is None:
        return t
    p = nl.ndarray(a.shape, dtype=a.dtype, buffer=buffer)  # PSUM: through a compute engine, not a DMA
    nisa.tensor_copy(dst=p, src=t)
    return p


def index_tile(rows):
    """(len(rows), 1) int32 in SBUF holding `rows` (iota with channel_multiplier: row p = rows[0] + p * step)."""
    i = nl.ndarray((len(rows), 1), dtype=nl.int32, buffer=nl.sbuf)
    step = rows[1] - rows[0] if len(rows) > 1 else 0
    nisa.iota(dst=i, pattern=[[1, 1]], offset=rows[0], channel_multiplier=step)
    return i


@nki.jit
def k_ds_start(a, bad):
    nisa.dma_copy(dst=sb((2, 4)), src=a[nl.ds(1.5 if bad else 1, 2)])
    return a


@nki.jit
def k_slice_indirect(a, bad):
    g = a.ap(pattern=[[4, 2], [1, 4]], vector_offset=index_tile([0, 2]), indirect_dim=0)
    nisa.dma_copy(dst=sb((1, 4) if bad else (2, 4)), src=g[0:1] if bad else g)
    return a


@nki.jit
def k_too_many_indices(a, bad):
    nisa.dma_copy(dst=sb((1, 1)), src=load(a)[0, 0, 0] if bad else load(a)[0, 0])
    return a


@nki.jit
def k_index_range(a, bad):
    nisa.dma_copy(dst=sb((1, 4)), src=a[4 if bad else 3].reshape((1, 4)))
    return a


@nki.jit
def k_negative_step(a, bad):
    nisa.dma_copy(dst=sb((4, 4)), src=a[::-1 if bad else 1])
    return a


@nki.jit
def k_empty_slice(a, bad):
    nisa.dma_copy(dst=sb((1, 4)), src=a[2:2 if bad else 3])
    return a


@nki.jit
def k_unsupported_index(a, bad):
    nisa.dma_copy(dst=sb((1, 4)), src=a[None if bad else 0].reshape((1, 4)))
    return a


@nki.jit
def k_reshape_size(a, bad):
    nisa.dma_copy(dst=sb((3, 5) if bad else (2, 8)), src=a.reshape((3, 5) if bad else (2, 8)))
    return a


@nki.jit
def k_reshape_strided(a, bad):
    nisa.dma_copy(dst=sb((2, 4)), src=(a[:, ::2] if bad else a[0:2, :]).reshape((2, 4)))
    return a


@nki.jit
def k_reshape_partitions(a, bad):
    t = load(a).reshape((2, 8) if bad else (4, 2, 2))
    nisa.memset(dst=t, value=0.0)
    return a


@nki.jit
def k_ap_pattern(a, bad):
    nisa.dma_copy(dst=sb((4, 4)), src=a.ap(pattern=[[4, 4, 1]] if bad else [[4, 4], [1, 4]]))
    return a


@nki.jit
def k_ap_scalar_offset(a, bad):
    nisa.dma_copy(dst=sb((4, 4)), src=a.ap(pattern=[[4, 4], [1, 4]], scalar_offset=0 if bad else None))
    return a


@nki.jit
def k_reindirect(a, bad):
    g = a.ap(pattern=[[4, 2], [1, 4]], vector_offset=index_tile([0, 2]), indirect_dim=0)
    nisa.dma_copy(dst=sb((2, 4)), src=g.ap(pattern=[[4, 2], [1, 4]]) if bad else g)
    return a


@nki.jit
def k_index_tile_count(a, bad):
    n = 3 if bad else 2  # pattern[0] rows gathered; the index tile has 2
    nisa.dma_copy(dst=sb((n, 4)), src=a.ap(pattern=[[4, n], [1, 4]], vector_offset=index_tile([0, 2])))
    return a


@nki.jit
def k_vector_offset_on_chip(a, bad):
    src = load(a) if bad else a
    nisa.dma_copy(dst=sb((2, 4)), src=src.ap(pattern=[[4, 2], [1, 4]], vector_offset=index_tile([0, 2])))
    return a


@nki.jit
def k_indirect_dim(a, bad):
    g = a.ap(pattern=[[4, 2], [1, 4]], vector_offset=index_tile([0, 2]), indirect_dim=1 if bad else 0)
    nisa.dma_copy(dst=sb((2, 4)), src=g)
    return a


@nki.jit
def k_pattern_leaves(a, bad):
    n = 8 if bad else 4
    nisa.dma_copy(dst=sb((n, 4)), src=a.ap(pattern=[[4, n], [1, 4]]))
    return a


@nki.jit
def k_compute_on_hbm(a, bad):
    out = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.tensor_copy(dst=out if bad else sb((4, 4)), src=load(a))
    return a


@nki.jit
def k_one_d_operand(a, bad):
    t, u = load(a), sb((4, 4))
    nisa.tensor_copy(dst=u[:, 0] if bad else u[:, 0:1], src=t[:, 0] if bad else t[:, 0:1])  # int: drops dim 1
    return a


@nki.jit
def k_strided_partitions(a, bad):
    nisa.tensor_copy(dst=sb((2, 4)), src=load(a)[0:4:2] if bad else load(a)[0:2])
    return a


@nki.jit
def k_partition_counts(a, bad):
    nisa.tensor_copy(dst=sb((2, 4) if bad else (4, 4)), src=load(a))
    return a


@nki.jit
def k_free_sizes(a, bad):
    nisa.tensor_tensor(dst=sb((4, 4)), data1=load(a), data2=load(a)[:, 0:2] if bad else load(a), op=nl.add)
    return a


@nki.jit
def k_alu_as_function(a, bad):
    t = load(a)
    if bad:
        nl.add(t, t)
    else:
        nisa.tensor_tensor(dst=sb((4, 4)), data1=t, data2=t, op=nl.add)
    return a


@nki.jit
def k_op_token(a, bad):
    nisa.tensor_tensor(dst=sb((4, 4)), data1=load(a), data2=load(a), op="add" if bad else nl.add)
    return a


@nki.jit
def k_dst_first(a, bad):
    t, m = load(a), sb((4, 8))
    if bad:
        m = nisa.max8(src=t)
    else:
        nisa.max8(dst=m, src=t)
    return a


@nki.jit
def k_operand_tile_dtype(a, bad):
    o = sb((4, 1), nl.int32 if bad else nl.float32)
    nisa.memset(dst=o, value=1 if bad else 1.0)
    nisa.tensor_scalar(dst=sb((4, 4)), data=load(a), op0=nl.add, operand0=o)
    return a


@nki.jit
def k_operand_tile_shape(a, bad):
    o = sb((4, 2) if bad else (4, 1))
    nisa.memset(dst=o, value=1.0)
    nisa.tensor_scalar(dst=sb((4, 4)), data=load(a), op0=nl.add, operand0=o)
    return a


@nki.jit
def k_operand_scalar(a, bad):
    nisa.tensor_scalar(dst=sb((4, 4)), data=load(a), op0=nl.add, operand0=1 if bad else 1.0)
    return a


@nki.jit
def k_dma_not_tensor(a, bad):
    nisa.dma_copy(dst=sb((4, 4)), src=0.0 if bad else a)
    return a


@nki.jit
def k_dma_psum(a, bad):
    out = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=load(a, nl.psum) if bad else load(a))
    return out


@nki.jit
def k_dma_counts(a, bad):
    nisa.dma_copy(dst=sb((4, 2) if bad else (4, 4)), src=a)
    return a


@nki.jit
def k_dma_both_indirect(a, bad):
    out = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=a)
    src = a.ap(pattern=[[4, 2], [1, 4]], vector_offset=index_tile([0, 2]))
    dst = out.ap(pattern=[[4, 2], [1, 4]], vector_offset=index_tile([1, 3])) if bad else sb((2, 4))
    nisa.dma_copy(dst=dst, src=src)
    return out


@nki.jit
def k_hwdge(a, bad):
    g = a.ap(pattern=[[4, 2], [1, 4]], vector_offset=index_tile([0, 2]))
    nisa.dma_copy(dst=sb((2, 4)), src=g, dge_mode=nisa.dge_mode.hwdge if bad else nisa.dge_mode.swdge)
    return a


@nki.jit
def k_memset_int(a, bad):
    nisa.memset(dst=sb((4, 4), nl.int32), value=1.0 if bad else 1)
    return a


@nki.jit
def k_memset_float(a, bad):
    nisa.memset(dst=sb((4, 4)), value=1 if bad else 1.0)
    return a


@nki.jit
def k_iota_buffer(a, bad):
    nisa.iota(dst=sb((4, 4), nl.int32, nl.psum if bad else nl.sbuf), pattern=[[1, 4]])
    return a


@nki.jit
def k_iota_pattern(a, bad):
    nisa.iota(dst=sb((4, 4), nl.int32), pattern=[[1, 3 if bad else 4]])
    return a


@nki.jit
def k_tensor_tensor_psum(a, bad):
    p = load(a, nl.psum)
    nisa.tensor_tensor(dst=sb((4, 4)), data1=p, data2=load(a, nl.psum) if bad else load(a), op=nl.add)
    return a


@nki.jit
def k_operand1_without_op1(a, bad):
    nisa.tensor_scalar(dst=sb((4, 4)), data=load(a), op0=nl.add, operand0=1.0, operand1=2.0 if bad else None)
    return a


@nki.jit
def k_reduce_op(a, bad):
    nisa.tensor_reduce(dst=sb((4, 1)), op=nl.equal if bad else nl.maximum, data=load(a), axis=1)
    return a


@nki.jit
def k_reduce_subtract(a, bad):
    nisa.tensor_reduce(dst=sb((4, 1)), op=nl.subtract if bad else nl.add, data=load(a), axis=1)
    return a


@nki.jit
def k_reduce_dst(a, bad):
    nisa.tensor_reduce(dst=sb((4, 2) if bad else (4, 1)), op=nl.maximum, data=load(a), axis=1)
    return a


@nki.jit
def k_scan_psum(a, bad):
    p = load(a, nl.psum)
    nisa.tensor_tensor_scan(dst=sb((4, 4)), data0=p, data1=load(a, nl.psum) if bad else load(a), initial=0.0,
                            op0=nl.multiply, op1=nl.add)
    return a


@nki.jit
def k_max8_dst(a, bad):
    nisa.max8(dst=sb((4, 4) if bad else (4, 8)), src=load(a))
    return a


@nki.jit
def k_find8_vals(a, bad):
    vals = sb((4, 4) if bad else (4, 8))
    nisa.memset(dst=vals, value=0.0)
    nisa.nc_find_index8(dst=sb((4, 8), nl.uint32), data=load(a), vals=vals)
    return a


@nki.jit
def k_find8_dst_dtype(a, bad):
    vals = sb((4, 8))
    nisa.memset(dst=vals, value=0.0)
    nisa.nc_find_index8(dst=sb((4, 8), nl.int32 if bad else nl.uint32), data=load(a), vals=vals)
    return a


@nki.jit
def k_find8_partitions(a, bad):
    p = 2 if bad else 4  # data has 4 partitions
    vals = sb((p, 8))
    nisa.memset(dst=vals, value=0.0)
    nisa.nc_find_index8(dst=sb((p, 8), nl.uint32), data=load(a), vals=vals)
    return a


@nki.jit
def k_ndarray_list(a, bad):
    nisa.memset(dst=nl.ndarray([4, 4] if bad else (4, 4), dtype=nl.float32, buffer=nl.sbuf), value=0.0)
    return a


@nki.jit
def k_ndarray_empty(a, bad):
    nisa.memset(dst=sb((4, 0) if bad else (4, 4)), value=0.0)
    return a


@nki.jit
def k_ndarray_buffer(a, bad):
    nisa.memset(dst=nl.ndarray((4, 4), dtype=nl.float32, buffer="sbuf" if bad else nl.sbuf), value=0.0)
    return a


@nki.jit
def k_ndarray_dtype(a, bad):
    nisa.memset(dst=nl.ndarray((4, 4), dtype="float64" if bad else nl.float32, buffer=nl.sbuf), value=0.0)
    return a


@nki.jit
def k_ndarray_1d_on_chip(a, bad):
    nisa.memset(dst=sb((4,) if bad else (4, 1)), value=0.0)
    return a


@nki.jit
def k_ndarray_partitions(a, bad):
    nisa.memset(dst=sb((129, 4) if bad else (128, 4)), value=0.0)
    return a


@nki.jit
def k_returns(a, bad):
    return 1.0 if bad else a


A44 = x((4, 4))
IDX = np.array([[3], [0], [9]], dtype=np.int32)
D106 = x((10, 6))
# (id, kernel, arguments of a kernel that keeps every rule or None, arguments that break one, match)
RULES = [
    ("nl.ds start/size are ints", k_ds_start, (A44, False), (A44, True), "compile-time int"),
    ("an indirect view is not sliced", k_slice_indirect, (A44, False), (A44, True), "cannot be sliced further"),
    ("no more indices than dims", k_too_many_indices, (A44, False), (A44, True), "too many indices"),
    ("indices in range", k_index_range, (A44, False), (A44, True), "index 4 out of range"),
    ("no negative slice steps", k_negative_step, (A44, False), (A44, True), "negative slice steps"),
    ("no empty slices", k_empty_slice, (A44, False), (A44, True), "empty slice"),
    ("int / slice / nl.ds / ... indices only", k_unsupported_index, (A44, False), (A44, True), "unsupported index"),
    ("reshape keeps the size", k_reshape_size, (A44, False), (A44, True), "sizes differ"),
    ("reshape of contiguous views only", k_reshape_strided, (A44, False), (A44, True), "non-contiguous view"),
    ("on-chip reshape keeps the partition dim", k_reshape_partitions, (A44, False), (A44, True),
     "cannot change the partition dim"),
    (".ap pattern is [stride, count] pairs", k_ap_pattern, (A44, False), (A44, True), r"\[stride, count\] pairs"),
    (".ap scalar_offset not modelled", k_ap_scalar_offset, (A44, False), (A44, True), "scalar_offset"),
    ("an indirect view is not re-indirected", k_reindirect, (A44, False), (A44, True), "cannot be re-indirected"),
    ("index tile is in SBUF", gather_rows, (D106, IDX, I.nl.sbuf, 1), (D106, IDX, I.nl.hbm, 1),
     r"index tile must be an SBUF tensor of shape \(P, 1\)"),
    ("index tile is (P, 1)", gather_rows, (D106, IDX, I.nl.sbuf, 1),
     (D106, np.array([[3, 0], [9, 1]], np.int32), I.nl.sbuf, 2), r"\(P, 1\) int32/uint32 in SBUF, got \(2, 2\)"),
    ("index tile is int32 / uint32", gather_rows, (D106, IDX, I.nl.sbuf, 1),
     (D106, IDX.astype(F32), I.nl.sbuf, 1), r"\(P, 1\) int32/uint32 in SBUF, got \(3, 1\) float32"),
    ("index tile P = pattern[0] count", k_index_tile_count, (A44, False), (A44, True),
     r"index tile has 2 partitions, pattern\[0\] counts 3"),
    ("vector_offset indexes an HBM tensor", k_vector_offset_on_chip, (A44, False), (A44, True),
     "indexed tensor must be in HBM"),
    ("vector_offset on indirect_dim 0", k_indirect_dim, (A44, False), (A44, True), "indirect_dim=0 only"),
    ("access patterns stay inside the tensor", k_pattern_leaves, (A44, False), (A44, True), "leaves its tensor"),
    ("compute engines never touch HBM", k_compute_on_hbm, (A44, False), (A44, True), "SBUF/PSUM only"),
    ("compute operands are >= 2-D", k_one_d_operand, (A44, False), (A44, True), "at least 2-D"),
    ("compute operands cover contiguous partitions", k_strided_partitions, (A44, False), (A44, True),
     "contiguous partitions"),
    ("partition start rules", copy_rows, (x((128, 4)), 0, 128), (x((128, 4)), 5, 10), "starts at partition 5"),
    ("operands have equal partition counts", k_partition_counts, (A44, False), (A44, True),
     r"equal partition counts .*\(2, 4\) vs \(4, 4\)"),
    ("operands have equal elements per partition", k_free_sizes, (A44, False), (A44, True),
     r"elements per partition \(\(4, 4\) vs \(4, 2\)\)"),
    ("ALU ops are instruction ops, not tile functions", k_alu_as_function, (A44, False), (A44, True),
     "as a tile function"),
    ("op is an nl ALU token", k_op_token, (A44, False), (A44, True), "op must be an nl ALU op token"),
    ("dst-first instructions", k_dst_first, (A44.repeat(2, 1), False), (A44.repeat(2, 1), True),
     "destination tensor first"),
    ("tensor_scalar operand tiles are fp32", k_operand_tile_dtype, (A44, False), (A44, True),
     "operand0 tile must be float32, got int32"),
    ("tensor_scalar operand tiles are (P, 1)", k_operand_tile_shape, (A44, False), (A44, True),
     r"operand0 tile must be \(4, 1\)"),
    ("tensor_scalar scalars are fp32", k_operand_scalar, (A44, False), (A44, True), "float32 scalar"),
    ("dma_copy moves tensors", k_dma_not_tensor, (A44, False), (A44, True), "src must be an NkiTensor"),
    ("dma_copy never touches PSUM", k_dma_psum, (A44, False), (A44, True), "src is in PSUM"),
    ("dma_copy element counts match", k_dma_counts, (A44, False), (A44, True), "element counts differ"),
    ("dma_copy indirect on one side only", k_dma_both_indirect, (A44, False), (A44, True),
     "indirect on both sides"),
    ("vector_offset DMA needs swdge", k_hwdge, (A44, False), (A44, True), "needs swdge"),
    ("memset of an int tensor takes an int", k_memset_int, (A44, False), (A44, True), "must be an int"),
    ("memset of a float tensor takes a float", k_memset_float, (A44, False), (A44, True), "must be a float"),
    ("iota writes SBUF", k_iota_buffer, (A44, False), (A44, True), "iota: dst must be in SBUF"),
    ("iota pattern covers dst", k_iota_pattern, (A44, False), (A44, True), "does not cover 4 elements"),
    ("tensor_tensor inputs not both in PSUM", k_tensor_tensor_psum, (A44, False), (A44, True),
     "tensor_tensor: data1 and data2 cannot both be in PSUM"),
    ("tensor_scalar operand1 needs op1", k_operand1_without_op1, (A44, False), (A44, True),
     "operand1 given without op1"),
    ("tensor_reduce op is a reduction", k_reduce_op, (A44, False), (A44, True), "is not a reduction op"),
    ("tensor_reduce keeps the partition axis", reduce_axis, (x((4, 2, 8)), 2, (4, 2)), (x((4, 2, 8)), 0, (1, 2)),
     "axis 0 is the partition dim"),
    ("tensor_reduce axes trailing", reduce_axis, (x((4, 2, 8)), 2, (4, 2)), (x((4, 2, 8)), (1,), (4, 8)),
     "trailing contiguous"),
    ("tensor_reduce subtract not modelled", k_reduce_subtract, (A44, False), (A44, True),
     "subtract reduction is not modelled"),
    ("tensor_reduce dst matches", k_reduce_dst, (A44, False), (A44, True), "does not match the reduced shape"),
    ("tensor_tensor_scan inputs not both in PSUM", k_scan_psum, (A44, False), (A44, True),
     "tensor_tensor_scan: data0 and data1 cannot both be in PSUM"),
    ("max8 / find_index8 read 8..16384 per partition", top8, (x((2, 8)), False), (x((2, 7)), False),
     "has 7 elements per partition"),
    ("max8 dst holds 8 per partition", k_max8_dst, (A44.repeat(2, 1), False), (A44.repeat(2, 1), True),
     r"max8: dst must be \(4, 8\)"),
    ("find_index8 vals hold 8 per partition", k_find8_vals, (A44.repeat(2, 1), False), (A44.repeat(2, 1), True),
     "vals and dst hold 8 elements per partition"),
    ("find_index8 dst is uint32 / uint16", k_find8_dst_dtype, (A44.repeat(2, 1), False),
     (A44.repeat(2, 1), True), "dst must be uint32 or uint16, got int32"),
    ("find_index8 data and dst partitions", k_find8_partitions, (A44.repeat(2, 1), False),
     (A44.repeat(2, 1), True), "data and dst need the same partition count"),
    ("ndarray shape is a tuple", k_ndarray_list, (A44, False), (A44, True), "shape must be a tuple"),
    ("ndarray shape non-empty, positive", k_ndarray_empty, (A44, False), (A44, True), "non-empty and positive"),
    ("ndarray buffer is an nl buffer", k_ndarray_buffer, (A44, False), (A44, True), "buffer must be nl.sbuf"),
    ("ndarray dtype modelled", k_ndarray_dtype, (A44, False), (A44, True), "dtype 'float64' not modelled"),
    ("on-chip ndarray >= 2-D", k_ndarray_1d_on_chip, (A44, False), (A44, True), "on-chip tensors are at least 2-D"),
    ("on-chip partition dim <= 128", k_ndarray_partitions, (A44, False), (A44, True), "partition dim 129 > 128"),
    ("kernel arguments are not lists", output_in, (A44, I.nl.shared_hbm), (A44, [I.nl.shared_hbm]),
     "may not be lists"),
    ("no torch int64 arguments", output_in, (torch.zeros(2, 2, dtype=torch.int32), I.nl.shared_hbm),
     (torch.zeros(2, 2, dtype=torch.int64), I.nl.shared_hbm), "torch.int64 has no NKI equivalent"),
    ("no numpy int64 / float64 arguments", output_in, (np.zeros((2, 2), np.int32), I.nl.shared_hbm),
     (np.zeros((2, 2), np.float64), I.nl.shared_hbm), "float64 has no NKI equivalent"),
    ("kernels return tensors", k_returns, (A44, False), (A44, True), "kernels return tensors"),
    ("outputs live in shared_hbm", output_in, (A44, I.nl.shared_hbm), (A44, I.nl.hbm), "shared_hbm"),
]
# raise sites the modelled API cannot reach (internal invariants, checked again where a kernel can break them)
UNREACHABLE = {
    "spans {n} partitions": "a view covering > 128 partitions would leave its tensor: ndarray caps the partition "
                            "dim at 128 and _flat raises 'leaves its tensor' first",
    "elements per partition, \"": "every instruction checks dst's size against its operands (_same_layout, "
                                  "max8 / find_index8 / tensor_reduce dst checks) before writing",
}


@pytest.mark.parametrize("kernel,good,bad,match", [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_each_rule_fails_exactly_its_kernel(kernel, good, bad, match):
    if good is not None:
        run(kernel, *good)  # the same kernel keeping the rule runs
    with pytest.raises(NkiRuleError, match=match):
        run(kernel, *bad)


def test_every_raise_site_has_a_failing_kernel():
    """The docstring's claim, checked: each `raise NkiRuleError` in nki_interp.py is reached by a RULES case
    (or is listed in UNREACHABLE with the reason)."""
    import ast
    import inspect
    src = inspect.getsource(nki_interp)
    lines = src.splitlines()
    sites = {n.lineno for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call)
             and getattr(n.exc.func, "id", None) == "NkiRuleError"}
    unreachable = {ln for ln in sites if any(key in "\n".join(lines[ln - 1:ln + 1]) for key in UNREACHABLE)}
    assert len(unreachable) == len(UNREACHABLE), sorted(unreachable)
    hit = {}
    for name, kernel, _, bad, _ in RULES:
        with pytest.raises(NkiRuleError) as e:
            run(kernel, *bad)
        tb = e.tb
        where = None
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == nki_interp.__file__:
                where = tb.tb_lineno
            tb = tb.tb_next
        hit.setdefault(where, []).append(name)
    missing = sites - unreachable - set(hit)
    assert not missing, "raise sites no kernel reaches: " + "; ".join(lines[ln - 1].strip() for ln in sorted(missing))
    assert not (set(hit) - sites), hit  # every case ends at a raise statement of the interpreter
