"""A NumPy interpreter of exactly the NKI 0.6 subset that the kernels in `kernels/` use.

The real `nki` package (and its `nki.simulate`) ships only on AWS's Neuron pip repository. This module runs the
same kernel functions on CPU: `simulate(kernel)(*arrays)` rebinds the kernel's `nki` / `nl` / `nisa` globals to
the stand-ins below (a copy of its globals, see `kernels.nki_api.rebind`; nothing goes into `sys.modules`) and
executes it eagerly, one instruction after another.

Modelled (names and argument order as in the NKI 0.6 stubs, aws-neuron-sdk nki/api):
  nki.jit; nl: the dtypes used here, sbuf / psum / hbm / private_hbm / shared_hbm, tile_size.pmax, ndarray, ds,
  the ALU op tokens (add subtract multiply maximum minimum equal not_equal greater greater_equal less
  less_equal); NkiTensor views: [] (int, slice, nl.ds, ...), reshape, ap(pattern, offset, vector_offset,
  indirect_dim); nisa: dma_copy, memset, iota, tensor_copy, tensor_tensor, tensor_scalar, tensor_reduce,
  tensor_tensor_scan, max8, nc_find_index8, and the oob_mode / dge_mode / engine enums.

Rules enforced (each raises NkiRuleError naming the rule):
  - on-chip (SBUF/PSUM) tensors: partition dim (dim 0) <= 128;
  - compute instructions touch contiguous partitions that start where the hardware allows (> 64 partitions
    start at 0; 33..64 at 0 or 64; <= 32 at 0, 32, 64 or 96), operands have equal partition counts, compute
    engines never read or write HBM;
  - dst-first calls: every nisa instruction takes the destination tensor first and returns no tile;
  - tensor_reduce reduces free axes only, trailing and contiguous;
  - vector_offset index tiles are (P, 1) int32/uint32 in SBUF, on an HBM tensor, P = pattern[0] count;
  - max8 / nc_find_index8 read 8..16384 elements per partition, vals/dst hold 8 per partition;
  - tensors a kernel returns are allocated in nl.shared_hbm (or are input arguments, NxDI's in-place pattern);
  - dma_copy never reads (or writes) PSUM; element counts of src and dst match;
  - tensor_scalar operands are fp32 (scalars or (P,1) tiles); memset values match the dtype's kind;
  - iota writes SBUF; tensor_tensor / scan inputs are not both in PSUM; no int64 / float64 kernel arguments.
tests/test_nki_interp.py has a kernel that breaks each rule (RULES, each beside the same kernel keeping it),
and test_every_raise_site_has_a_failing_kernel checks that every `raise NkiRuleError` in this file is reached
by one, including the modelling limits ("... not modelled") and the view rules (indices, slices, reshape,
.ap). Two raises are internal invariants no kernel can reach, because an earlier check fires first: a compute
operand spanning > 128 partitions (ndarray caps dim 0 at 128, so such a view leaves its tensor) and a result
whose size differs from dst's (every instruction compares dst with its operands before writing).
Runtime behaviour modelled: fresh tensors hold garbage (NaN for floats, 0xDEADBEEF bit patterns for ints) as the
official simulator's sentinels do, so reads of unwritten memory show; float arithmetic in fp32 with the result
cast to dst (bf16: round to nearest even; float -> int: round to nearest even and saturate, NaN -> 0);
int32/uint32-only tensor_tensor in exact integer math (GpSimd); DMA dtype conversion through fp32; indirect
DMA out-of-bounds rows raise NkiRuntimeError (oob_mode.error) or are skipped (oob_mode.skip); two partitions of
one indirect write hitting the same row leave garbage in that row (write order is undefined on hardware).

Not modelled: SBUF/PSUM capacity and alignment, engine choice / timing / overlap / dependency tracking (the
program runs in order), ISA free-dim limits (uint16 sizes, int16 strides), NaN ordering in max8, LNC grids,
dynamic loops, registers, scalar_offset, and every instruction not listed above (a kernel that calls one fails
with AttributeError).
"""
from __future__ import annotations

import types
from math import prod

import numpy as np

from . import nki_api

PMAX = 128
FIND8_MIN, FIND8_MAX = 8, 16384


class NkiRuleError(Exception):
    """The kernel breaks a documented NKI rule (what the compiler or the hardware rejects)."""


class NkiRuntimeError(Exception):
    """A fault the device raises at run time (out-of-bounds indirect DMA with oob_mode.error)."""


# ----------------------------------------------------------------------------------------------- dtypes
FLOATS = ("float32", "bfloat16", "float16")
INTS = ("int32", "uint32", "int16", "uint16", "int8", "uint8")
_STORE = {"float32": np.float32, "bfloat16": np.float32, "float16": np.float16, "int32": np.int32,
          "uint32": np.uint32, "int16": np.int16, "uint16": np.uint16, "int8": np.int8, "uint8": np.uint8}


def _round_bf16(x32: np.ndarray) -> np.ndarray:
    """fp32 -> nearest-even bf16, kept in fp32 storage."""
    x32 = np.ascontiguousarray(x32, dtype=np.float32)
    b = x32.view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x32), np.float32(np.nan), r).astype(np.float32)


def _from_f32(x, dtype: str) -> np.ndarray:
    """Cast fp32 (or exact float64) values to `dtype` the way the engines do."""
    x = np.asarray(x)
    if dtype == "float32":
        return x.astype(np.float32)
    if dtype == "bfloat16":
        return _round_bf16(x.astype(np.float32))
    if dtype == "float16":
        return x.astype(np.float16)
    info = np.iinfo(_STORE[dtype])
    f = np.nan_to_num(np.rint(x.astype(np.float64)), nan=0.0)
    return np.clip(f, info.min, info.max).astype(_STORE[dtype])


def _wrap_int(x, dtype: str) -> np.ndarray:
    """Exact integer results written to an integer dtype (two's-complement wrap)."""
    bits = np.dtype(_STORE[dtype]).itemsize * 8
    u = np.asarray(x, dtype=np.int64) & ((1 << bits) - 1)
    return u.astype(np.uint64).astype(np.dtype(f"uint{bits}")).view(_STORE[dtype])


def _garbage(n: int, dtype: str) -> np.ndarray:
    if dtype in FLOATS:
        return np.full(n, np.nan, dtype=_STORE[dtype])
    bits = np.dtype(_STORE[dtype]).itemsize * 8
    return np.full(n, 0xDEADBEEF & ((1 << bits) - 1), dtype=np.dtype(f"uint{bits}")).view(_STORE[dtype])


# ----------------------------------------------------------------------------------------------- buffers
class _Buffer:
    def __init__(self, name: str, on_chip: bool):
        self.name, self.on_chip = name, on_chip

    def __repr__(self):
        return f"nl.{self.name}"


SBUF, PSUM = _Buffer("sbuf", True), _Buffer("psum", True)
PRIVATE_HBM, SHARED_HBM = _Buffer("private_hbm", False), _Buffer("shared_hbm", False)
_INPUT_HBM = _Buffer("hbm (kernel argument)", False)


class _Storage:
    def __init__(self, shape, dtype, buffer, name, data=None):
        self.shape, self.dtype, self.buffer, self.name = tuple(shape), dtype, buffer, name
        n = prod(self.shape)
        self.data = _garbage(n, dtype) if data is None else data
        self.fsize = max(1, prod(self.shape[1:]))  # element stride of one partition (on-chip)


class DynamicSlice:
    def __init__(self, start, size):
        if not isinstance(start, (int, np.integer)) or not isinstance(size, (int, np.integer)):
            raise NkiRuleError("nl.ds: only compile-time int start/size are modelled")
        self.start, self.size = int(start), int(size)


def _contiguous_strides(shape):
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


class NkiTensor:
    """A view (shape, element strides, offset) of a storage in one buffer."""

    def __init__(self, st: _Storage, shape, strides, offset, vector_offset=None, ind_stride=0, ind_bound=0):
        self._st = st
        self.shape, self.strides, self.offset = tuple(int(s) for s in shape), tuple(strides), int(offset)
        self.dtype, self.buffer, self.name = st.dtype, st.buffer, st.name
        self.ndim, self.size = len(self.shape), prod(self.shape)
        self._vec, self._ind_stride, self._ind_bound = vector_offset, ind_stride, ind_bound

    def __repr__(self):
        return f"NkiTensor({self.name or '?'}, {self.shape}, {self.dtype}, {self.buffer})"

    @property
    def on_chip(self):
        return self.buffer.on_chip

    def is_indirect(self):
        return self._vec is not None

    def __getitem__(self, key):
        if self._vec is not None:
            raise NkiRuleError("an indirect view cannot be sliced further")
        key = key if isinstance(key, tuple) else (key,)
        if any(k is Ellipsis for k in key):
            i = key.index(Ellipsis)
            key = key[:i] + (slice(None),) * (self.ndim - len(key) + 1) + key[i + 1:]
        if len(key) > self.ndim:
            raise NkiRuleError(f"too many indices for {self}")
        key = key + (slice(None),) * (self.ndim - len(key))
        shape, strides, off = [], [], self.offset
        for d, (k, n, s) in enumerate(zip(key, self.shape, self.strides)):
            if isinstance(k, DynamicSlice):
                k = slice(k.start, k.start + k.size)
            if isinstance(k, (int, np.integer)):
                k = int(k) + (n if k < 0 else 0)
                if not 0 <= k < n:
                    raise NkiRuleError(f"index {k} out of range for dim {d} of {self}")
                off += k * s
                if d == 0 and self.on_chip:  # on-chip: an int on the partition dim keeps a size-1 dim
                    shape.append(1)
                    strides.append(s)
            elif isinstance(k, slice):
                start, stop, step = k.indices(n)
                if step <= 0:
                    raise NkiRuleError("negative slice steps are not modelled")
                if stop <= start:
                    raise NkiRuleError(f"empty slice {k} of dim {d} of {self}")
                off += start * s
                shape.append(len(range(start, stop, step)))
                strides.append(s * step)
            else:
                raise NkiRuleError(f"unsupported index {k!r}")
        return NkiTensor(self._st, shape, strides, off)

    def _is_contiguous(self):
        want = _contiguous_strides(self.shape)
        dims = range(1, self.ndim) if self.on_chip else range(self.ndim)
        return all(self.shape[d] == 1 or self.strides[d] == want[d] for d in dims)

    def reshape(self, shape):
        shape = tuple(int(s) for s in shape)
        if prod(shape) != self.size:
            raise NkiRuleError(f"reshape {self.shape} -> {shape}: sizes differ")
        if self._vec is not None or not self._is_contiguous():
            raise NkiRuleError(f"reshape of a non-contiguous view {self}")
        if self.on_chip:
            if shape[0] != self.shape[0]:
                raise NkiRuleError("reshape of an on-chip tensor cannot change the partition dim")
            return NkiTensor(self._st, shape, (self.strides[0],) + _contiguous_strides(shape)[1:], self.offset)
        return NkiTensor(self._st, shape, _contiguous_strides(shape), self.offset)

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None):
        if isinstance(pattern, tuple):
            pattern = list(pattern)
        if not isinstance(pattern, list) or not all(len(p) == 2 for p in pattern):
            raise NkiRuleError(".ap(pattern=...): a list of [stride, count] pairs")
        if scalar_offset is not None or dtype is not None:
            raise NkiRuleError(".ap(scalar_offset=/dtype=) is not modelled by kernels/nki_interp.py")
        if self._vec is not None:
            raise NkiRuleError("an indirect view cannot be re-indirected")
        shape = [int(c) for _, c in pattern]
        strides = [int(s) for s, _ in pattern]
        off = self.offset + (0 if offset is None else int(offset))
        if vector_offset is None:
            return NkiTensor(self._st, shape, strides, off)
        v = vector_offset
        if not isinstance(v, NkiTensor) or v.buffer is not SBUF:
            raise NkiRuleError(f"index tile must be an SBUF tensor of shape (P, 1), got {v!r}")
        if v.ndim != 2 or v.shape[1] != 1 or v.dtype not in ("int32", "uint32"):
            raise NkiRuleError(f"index tile must be (P, 1) int32/uint32 in SBUF, got {v.shape} {v.dtype}")
        if v.shape[0] != shape[0]:
            raise NkiRuleError(f"index tile has {v.shape[0]} partitions, pattern[0] counts {shape[0]}")
        if self.on_chip:
            raise NkiRuleError("vector_offset indexes an HBM tensor; the indexed tensor must be in HBM")
        if indirect_dim != 0:
            raise NkiRuleError("vector_offset supports indirect_dim=0 only")
        return NkiTensor(self._st, shape, strides, off, vector_offset=v,
                         ind_stride=self.strides[indirect_dim], ind_bound=self.shape[indirect_dim])


# ------------------------------------------------------------------------------------ element addressing
def _flat(t: NkiTensor):
    """Storage indices of every element (shape t.shape) and, for indirect views, the per-partition OOB mask."""
    idx = np.full(t.shape, t.offset, dtype=np.int64)
    for d, (n, s) in enumerate(zip(t.shape, t.strides)):
        if d == 0 and t._vec is not None:
            continue
        idx = idx + (np.arange(n, dtype=np.int64) * s).reshape([n if e == d else 1 for e in range(t.ndim)])
    oob = None
    if t._vec is not None:
        rows = _read(t._vec).reshape(-1).astype(np.int64)
        oob = (rows < 0) | (rows >= t._ind_bound)
        idx = idx + (np.where(oob, 0, rows) * t._ind_stride).reshape([-1] + [1] * (t.ndim - 1))
    if idx.size and (idx.min() < 0 or idx.max() >= t._st.data.size):
        raise NkiRuleError(f"access pattern of {t} leaves its tensor ({t._st.shape})")
    return idx, oob


def _read(t: NkiTensor) -> np.ndarray:
    idx, _ = _flat(t)
    return t._st.data[idx]


def _partitions(t: NkiTensor, op: str, what: str):
    """(start partition, count) of an on-chip operand; checks the placement rules."""
    if not t.on_chip:
        raise NkiRuleError(f"nisa.{op}: {what} is in {t.buffer}; compute engines read and write SBUF/PSUM only")
    if t.ndim < 2:
        raise NkiRuleError(f"nisa.{op}: {what} must be at least 2-D (partition dim first)")
    fs = t._st.fsize
    idx, _ = _flat(t)
    part = idx.reshape(t.shape[0], -1) // fs
    start, n = int(part[0, 0]), t.shape[0]
    if not np.all(part == (start + np.arange(n))[:, None]):
        raise NkiRuleError(f"nisa.{op}: {what} must cover contiguous partitions, one per index of dim 0")
    if n > PMAX:
        raise NkiRuleError(f"nisa.{op}: {what} spans {n} partitions (> {PMAX})")
    if (n > 64 and start != 0) or (32 < n <= 64 and start not in (0, 64)) or (n <= 32 and start % 32):
        raise NkiRuleError(f"nisa.{op}: {what} starts at partition {start} with {n} partitions; the hardware "
                           "needs start 0 for > 64, 0 or 64 for 33..64, a multiple of 32 for <= 32")
    return start, n


def _vals2d(t: NkiTensor, op: str, what: str) -> np.ndarray:
    _, n = _partitions(t, op, what)
    return _read(t).reshape(n, -1)


def _write2d(t: NkiTensor, values: np.ndarray, op: str, exact_int=False):
    _, n = _partitions(t, op, "dst")
    idx, _ = _flat(t)
    idx = idx.reshape(n, -1)
    if values.shape != idx.shape:
        raise NkiRuleError(f"nisa.{op}: dst {t.shape} has {idx.shape[1]} elements per partition, "
                           f"the result has {values.shape[1]}")
    t._st.data[idx] = _wrap_int(values, t.dtype) if exact_int else _from_f32(values, t.dtype)


def _same_layout(op, dst, *srcs):
    for s in srcs:
        if s.shape[0] != dst.shape[0] or s.size // s.shape[0] != dst.size // dst.shape[0]:
            raise NkiRuleError(f"nisa.{op}: operands need equal partition counts and elements per partition "
                               f"({dst.shape} vs {s.shape})")


# ------------------------------------------------------------------------------------------- ALU ops
class AluOp:
    def __init__(self, name, fn, reducible=False):
        self.name, self.fn, self.reducible = name, fn, reducible

    def __call__(self, *a, **k):
        raise NkiRuleError(f"nl.{self.name}(...) as a tile function is not in the modelled subset; pass it as "
                           "the op of a nisa instruction")

    def __repr__(self):
        return f"nl.{self.name}"


def _cmp(f):
    return lambda a, b: f(a, b).astype(a.dtype)


OPS = {n: AluOp(n, f, r) for n, f, r in [
    ("add", np.add, True), ("subtract", np.subtract, True), ("multiply", np.multiply, True),
    ("maximum", np.maximum, True), ("minimum", np.minimum, True),
    ("equal", _cmp(np.equal), False), ("not_equal", _cmp(np.not_equal), False),
    ("greater", _cmp(np.greater), False), ("greater_equal", _cmp(np.greater_equal), False),
    ("less", _cmp(np.less), False), ("less_equal", _cmp(np.less_equal), False)]}


def _op(op, where) -> AluOp:
    if not isinstance(op, AluOp):
        raise NkiRuleError(f"nisa.{where}: op must be an nl ALU op token (nl.add, nl.maximum, ...), got {op!r}")
    return op


# ------------------------------------------------------------------------------------------ instructions
class _Enum:
    def __init__(self, kind, **members):
        for k in members:
            setattr(self, k, f"{kind}.{k}")


oob_mode = _Enum("oob_mode", error=0, skip=1)
dge_mode = _Enum("dge_mode", unknown=0, swdge=1, hwdge=2, none=3)
engine = _Enum("engine", unknown=0, tensor=1, scalar=2, gpsimd=3, dma=4, vector=5, sync=6)

COUNTS: dict = {}


def _instruction(fn):
    name = fn.__name__

    def wrapper(*args, **kwargs):
        dst = args[0] if args else kwargs.get("dst")
        if not isinstance(dst, NkiTensor):
            raise NkiRuleError(f"nisa.{name}: NKI 0.6 instructions take the destination tensor first "
                               f"(dst-first, nothing returned); got {dst!r} as the first argument")
        COUNTS[name] = COUNTS.get(name, 0) + 1
        fn(*args, **kwargs)
        return None

    wrapper.__name__ = name
    return wrapper


def _f32_tile(t, op, what, parts):
    if isinstance(t, NkiTensor):
        if t.dtype != "float32":
            raise NkiRuleError(f"nisa.{op}: {what} tile must be float32, got {t.dtype}")
        v = _vals2d(t, op, what)
        if v.shape != (parts, 1):
            raise NkiRuleError(f"nisa.{op}: {what} tile must be ({parts}, 1), got {t.shape}")
        return v.astype(np.float32)
    if isinstance(t, (float, np.floating)) and not isinstance(t, bool):
        return np.float32(t)
    raise NkiRuleError(f"nisa.{op}: {what} must be a float32 scalar or (P, 1) float32 tile, got {t!r}")


@_instruction
def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=engine.unknown,
             name=None):
    for t, what in ((src, "src"), (dst, "dst")):
        if not isinstance(t, NkiTensor):
            raise NkiRuleError(f"nisa.dma_copy: {what} must be an NkiTensor, got {t!r}")
        if t.buffer is PSUM:
            raise NkiRuleError(f"nisa.dma_copy: {what} is in PSUM; dma_copy cannot access PSUM since NKI 0.3.0 "
                               "(tensor_copy it to SBUF first)")
    if src.size != dst.size:
        raise NkiRuleError(f"nisa.dma_copy: element counts differ (dst {dst.shape}, src {src.shape})")
    if src.is_indirect() and dst.is_indirect():
        raise NkiRuleError("nisa.dma_copy: indirect on both sides is not modelled")
    if (src.is_indirect() or dst.is_indirect()) and dge_mode == "dge_mode.hwdge":
        raise NkiRuleError("nisa.dma_copy: vector_offset gather/scatter needs swdge")
    s_idx, s_oob = _flat(src)
    vals = src._st.data[s_idx].reshape(-1)
    keep = np.ones(vals.size, dtype=bool)
    for t, oob in ((src, s_oob), (dst, None)):
        if t is dst:
            d_idx, oob = _flat(dst)
        if oob is not None and oob.any():
            if oob_mode != "oob_mode.skip":
                rows = _read(t._vec).reshape(-1)[oob]
                raise NkiRuntimeError(f"nisa.dma_copy: indirect row index {rows.tolist()} out of bounds "
                                      f"[0, {t._ind_bound}) (oob_mode=error)")
            keep &= np.repeat(~oob, t.size // t.shape[0])
    if src.dtype != dst.dtype:
        vals = _from_f32(vals.astype(np.float32), dst.dtype)  # conversion through fp32
    d_flat = d_idx.reshape(-1)
    dst._st.data[d_flat[keep]] = vals[keep]
    if dst.is_indirect():  # two partitions writing one row: undefined order on hardware -> garbage
        rows = _read(dst._vec).reshape(-1).astype(np.int64)
        live = rows[~((rows < 0) | (rows >= dst._ind_bound))]
        u, c = np.unique(live, return_counts=True)
        for r in u[c > 1]:
            hit = np.repeat(rows == r, dst.size // dst.shape[0])
            dst._st.data[d_flat[hit]] = _garbage(int(hit.sum()), dst.dtype)


@_instruction
def memset(dst, value, engine=engine.unknown, name=None):
    if dst.dtype in INTS:
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise NkiRuleError(f"nisa.memset: value {value!r} must be an int for a {dst.dtype} tensor")
        vals = np.full((dst.shape[0], dst.size // dst.shape[0]), value, dtype=np.int64)
        _write2d(dst, vals, "memset", exact_int=True)
    else:
        if not isinstance(value, (float, np.floating)):
            raise NkiRuleError(f"nisa.memset: value {value!r} must be a float for a {dst.dtype} tensor")
        _write2d(dst, np.full((dst.shape[0], dst.size // dst.shape[0]), value, dtype=np.float32), "memset")


@_instruction
def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    if dst.buffer is not SBUF:
        raise NkiRuleError("nisa.iota: dst must be in SBUF")
    p, free = dst.shape[0], dst.size // dst.shape[0]
    if prod(int(c) for _, c in pattern) != free:
        raise NkiRuleError(f"nisa.iota: pattern {pattern} does not cover {free} elements per partition")
    v = np.zeros([p] + [int(c) for _, c in pattern], dtype=np.int64) + int(offset)
    v += (np.arange(p) * int(channel_multiplier)).reshape([p] + [1] * len(pattern))
    for d, (step, c) in enumerate(pattern):
        v += (np.arange(int(c)) * int(step)).reshape([1] + [int(c) if e == d else 1 for e in range(len(pattern))])
    v = _wrap_int(v, "int32").astype(np.int64).reshape(p, free)  # int32 arithmetic
    if dst.dtype in INTS:
        _write2d(dst, v, "iota", exact_int=True)
    else:
        _write2d(dst, v.astype(np.float32), "iota")


@_instruction
def tensor_copy(dst, src, engine=engine.unknown, name=None):
    _same_layout("tensor_copy", dst, src)
    v = _vals2d(src, "tensor_copy", "src")
    if src.dtype == dst.dtype:
        _, n = _partitions(dst, "tensor_copy", "dst")
        dst._st.data[_flat(dst)[0].reshape(n, -1)] = v  # bit-exact
    else:
        _write2d(dst, v.astype(np.float32), "tensor_copy")


@_instruction
def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    op = _op(op, "tensor_tensor")
    _same_layout("tensor_tensor", dst, data1, data2)
    if data1.buffer is PSUM and data2.buffer is PSUM:
        raise NkiRuleError("nisa.tensor_tensor: data1 and data2 cannot both be in PSUM")
    a, b = _vals2d(data1, "tensor_tensor", "data1"), _vals2d(data2, "tensor_tensor", "data2")
    if all(t.dtype in ("int32", "uint32") for t in (dst, data1, data2)):  # GpSimd exact integer math
        _write2d(dst, op.fn(a.astype(np.int64), b.astype(np.int64)), "tensor_tensor", exact_int=True)
    else:
        _write2d(dst, op.fn(a.astype(np.float32), b.astype(np.float32)), "tensor_tensor")


@_instruction
def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=engine.unknown, name=None):
    _same_layout("tensor_scalar", dst, data)
    x = _vals2d(data, "tensor_scalar", "data").astype(np.float32)
    o0 = _f32_tile(operand0, "tensor_scalar", "operand0", x.shape[0])
    r = _op(op0, "tensor_scalar").fn(o0, x) if reverse0 else _op(op0, "tensor_scalar").fn(x, o0)
    if op1 is not None:
        o1 = _f32_tile(operand1, "tensor_scalar", "operand1", x.shape[0])
        r = _op(op1, "tensor_scalar").fn(o1, r) if reverse1 else _op(op1, "tensor_scalar").fn(r, o1)
    elif operand1 is not None:
        raise NkiRuleError("nisa.tensor_scalar: operand1 given without op1")
    _write2d(dst, np.asarray(r, dtype=np.float32), "tensor_scalar")


@_instruction
def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    op = _op(op, "tensor_reduce")
    if not op.reducible:
        raise NkiRuleError(f"nisa.tensor_reduce: {op} is not a reduction op")
    axes = sorted([axis] if isinstance(axis, (int, np.integer)) else list(axis))
    axes = [a + data.ndim if a < 0 else a for a in axes]
    if 0 in axes:
        raise NkiRuleError("nisa.tensor_reduce: axis 0 is the partition dim; only free axes can be reduced "
                           "(transpose first, or use a matmul with ones)")
    if not axes or axes != list(range(axes[0], data.ndim)):
        raise NkiRuleError(f"nisa.tensor_reduce: axes {axes} must be the trailing contiguous free dims of "
                           f"a {data.ndim}-D tile")
    _, n = _partitions(data, "tensor_reduce", "data")
    x = _read(data).astype(np.float32)
    kept = prod(data.shape[1:axes[0]])
    r = {"add": np.sum, "subtract": None, "multiply": np.prod, "maximum": np.max, "minimum": np.min}[op.name]
    if r is None:
        raise NkiRuleError("nisa.tensor_reduce: subtract reduction is not modelled")
    res = r(x.reshape(n, kept, -1), axis=2).astype(np.float32)
    if negate:
        res = -res
    if dst.shape[0] != n or dst.size // dst.shape[0] != kept:
        raise NkiRuleError(f"nisa.tensor_reduce: dst {dst.shape} does not match the reduced shape ({n}, {kept})")
    _write2d(dst, res, "tensor_reduce")


@_instruction
def tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False, name=None):
    _same_layout("tensor_tensor_scan", dst, data0, data1)
    if data0.buffer is PSUM and data1.buffer is PSUM:
        raise NkiRuleError("nisa.tensor_tensor_scan: data0 and data1 cannot both be in PSUM")
    a = _vals2d(data0, "tensor_tensor_scan", "data0").astype(np.float32)
    b = _vals2d(data1, "tensor_tensor_scan", "data1").astype(np.float32)
    prev = np.broadcast_to(_f32_tile(initial, "tensor_tensor_scan", "initial", a.shape[0]),
                           (a.shape[0], 1)).astype(np.float32)[:, 0]
    f0, f1 = _op(op0, "tensor_tensor_scan").fn, _op(op1, "tensor_tensor_scan").fn
    out = np.empty_like(a)
    for i in range(a.shape[1]):
        t = f0(prev, a[:, i]) if reverse0 else f0(a[:, i], prev)
        prev = (f1(b[:, i], t) if reverse1 else f1(t, b[:, i])).astype(np.float32)
        out[:, i] = prev
    _write2d(dst, out, "tensor_tensor_scan")


def _check_find8_free(t, op, what):
    free = t.size // t.shape[0]
    if not FIND8_MIN <= free <= FIND8_MAX:
        raise NkiRuleError(f"nisa.{op}: {what} has {free} elements per partition; must be "
                           f"{FIND8_MIN}..{FIND8_MAX}")


@_instruction
def max8(dst, src, name=None):
    _check_find8_free(src, "max8", "src")
    if dst.size // dst.shape[0] != 8 or dst.shape[0] != src.shape[0]:
        raise NkiRuleError(f"nisa.max8: dst must be ({src.shape[0]}, 8), got {dst.shape}")
    x = _vals2d(src, "max8", "src").astype(np.float32)
    top = -np.sort(-x, axis=1)[:, :8]
    _write2d(dst, top, "max8")


@_instruction
def nc_find_index8(dst, data, vals, name=None):
    _check_find8_free(data, "nc_find_index8", "data")
    if vals.size // vals.shape[0] != 8 or dst.size // dst.shape[0] != 8:
        raise NkiRuleError("nisa.nc_find_index8: vals and dst hold 8 elements per partition")
    if dst.dtype not in ("uint32", "uint16"):
        raise NkiRuleError(f"nisa.nc_find_index8: dst must be uint32 or uint16, got {dst.dtype}")
    _same_layout("nc_find_index8", vals, dst)
    if data.shape[0] != dst.shape[0]:
        raise NkiRuleError("nisa.nc_find_index8: data and dst need the same partition count")
    x = _vals2d(data, "nc_find_index8", "data").astype(np.float32)
    v = _vals2d(vals, "nc_find_index8", "vals").astype(np.float32)
    none = (1 << (32 if dst.dtype == "uint32" else 16)) - 1
    out = np.full(v.shape, none, dtype=np.int64)
    for p in range(x.shape[0]):
        for i in range(8):
            k = int(np.sum(v[p, :i] == v[p, i]))  # duplicates map to successive occurrences, ascending
            hits = np.flatnonzero(x[p] == v[p, i])
            if k < hits.size:
                out[p, i] = hits[k]
    _write2d(dst, out, "nc_find_index8", exact_int=True)


# ------------------------------------------------------------------------------------ nl.* and nki.jit
class _TileSize:
    pmax = PMAX


def ndarray(shape, dtype, buffer=SBUF, name="", address=None):
    if isinstance(shape, list):
        raise NkiRuleError("nl.ndarray: shape must be a tuple (lists are not allowed in NKI 0.3+)")
    shape = tuple(int(s) for s in shape)
    if not shape or any(s <= 0 for s in shape):
        raise NkiRuleError(f"nl.ndarray: shape {shape} must be non-empty and positive")
    if not isinstance(buffer, _Buffer):
        raise NkiRuleError(f"nl.ndarray: buffer must be nl.sbuf / nl.psum / nl.hbm / nl.shared_hbm, got {buffer!r}")
    if dtype not in _STORE:
        raise NkiRuleError(f"nl.ndarray: dtype {dtype!r} not modelled")
    if buffer.on_chip:
        if len(shape) < 2:
            raise NkiRuleError(f"nl.ndarray: on-chip tensors are at least 2-D (partition, free...), got {shape}")
        if shape[0] > PMAX:
            raise NkiRuleError(f"nl.ndarray: partition dim {shape[0]} > {PMAX} (nl.tile_size.pmax) for {buffer}")
    st = _Storage(shape, dtype, buffer, name)
    return NkiTensor(st, shape, _contiguous_strides(shape), 0)


def _module(name, **attrs):
    class _M(types.ModuleType):
        def __getattr__(self, a):
            raise AttributeError(f"{name}.{a} is not in the NKI subset kernels/nki_interp.py models")
    m = _M(name)
    m.__dict__.update(attrs)
    return m


nl = _module("nki.language", sbuf=SBUF, psum=PSUM, hbm=PRIVATE_HBM, private_hbm=PRIVATE_HBM,
             shared_hbm=SHARED_HBM, tile_size=_TileSize(), ndarray=ndarray, ds=DynamicSlice, NkiTensor=NkiTensor,
             **{d: d for d in FLOATS + INTS}, **OPS)
nisa = _module("nki.isa", dma_copy=dma_copy, memset=memset, iota=iota, tensor_copy=tensor_copy,
               tensor_tensor=tensor_tensor, tensor_scalar=tensor_scalar, tensor_reduce=tensor_reduce,
               tensor_tensor_scan=tensor_tensor_scan, max8=max8, nc_find_index8=nc_find_index8,
               oob_mode=oob_mode, dge_mode=dge_mode, engine=engine)


def _jit(fn=None, **kwargs):
    return (lambda f: f) if fn is None else fn


nki = _module("nki", jit=_jit, language=nl, isa=nisa)


# ---------------------------------------------------------------------------------------------- running
_TORCH_DT = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16",
             "torch.int32": "int32", "torch.int16": "int16", "torch.uint8": "uint8", "torch.int8": "int8"}


def _wrap_arg(a, inputs):
    if isinstance(a, list):
        raise NkiRuleError("kernel arguments may not be lists (use tuples)")
    if type(a).__module__.startswith("torch") and hasattr(a, "dtype") and hasattr(a, "detach"):
        dt = _TORCH_DT.get(str(a.dtype))
        if dt is None:
            raise NkiRuleError(f"kernel argument dtype {a.dtype} has no NKI equivalent (no int64/float64)")
        import torch
        arr = a.detach().cpu().contiguous().to(torch.float32 if dt == "bfloat16" else a.dtype).numpy()
        return _wrap_np(arr.reshape(-1).copy(), tuple(a.shape), dt, inputs), "torch"
    if isinstance(a, np.ndarray):
        dt = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(np.int32): "int32",
              np.dtype(np.uint32): "uint32", np.dtype(np.int16): "int16", np.dtype(np.uint16): "uint16",
              np.dtype(np.int8): "int8", np.dtype(np.uint8): "uint8"}.get(a.dtype)
        if dt is None:
            raise NkiRuleError(f"kernel argument dtype {a.dtype} has no NKI equivalent (no int64/float64)")
        return _wrap_np(np.ascontiguousarray(a).reshape(-1).copy(), a.shape, dt, inputs), "numpy"
    return a, None


def _wrap_np(flat, shape, dt, inputs):
    st = _Storage(shape, dt, _INPUT_HBM, "arg", data=flat.astype(_STORE[dt]))
    inputs.append(st)
    return NkiTensor(st, shape, _contiguous_strides(shape), 0)


def _unwrap(t: NkiTensor, kind):
    arr = _read(t).copy()
    if kind == "torch":
        import torch
        out = torch.from_numpy(arr)
        return out.to(torch.bfloat16) if t.dtype == "bfloat16" else out
    return arr


def simulate(kernel):
    """Like `nki.simulate(kernel)`: a callable that runs the kernel on NumPy / torch CPU arrays. The callable's
    `counts` attribute holds the instruction counts of its last run ({nisa name: count})."""
    bound = nki_api.rebind(kernel, {nki_api.nki: nki, nki_api.nl: nl, nki_api.nisa: nisa})

    def run(*args, **kwargs):
        inputs, kinds = [], []
        wrapped = []
        for a in args:
            w, kind = _wrap_arg(a, inputs)
            wrapped.append(w)
            kinds.append(kind)
        kw = {k: _wrap_arg(v, inputs)[0] for k, v in kwargs.items()}
        kind = next((k for k in kinds if k), "numpy")
        COUNTS.clear()
        out = bound(*wrapped, **kw)
        run.counts = dict(COUNTS)
        outs = out if isinstance(out, tuple) else (out,)
        for o in outs:
            if not isinstance(o, NkiTensor):
                raise NkiRuleError(f"kernel returned {o!r}; kernels return tensors")
            if o._st.buffer is not SHARED_HBM and not any(o._st is s for s in inputs):
                raise NkiRuleError(f"kernel output {o} must be allocated with buffer=nl.shared_hbm "
                                   "(or be an input argument)")
        res = tuple(_unwrap(o, kind) for o in outs)
        return res if isinstance(out, tuple) else res[0]

    run.counts = {}
    return run
