"""The decode and verify passes' CPU ops, row-invariant for up to ROW_INVARIANT_ROWS rows (csrc/decode_kernels.c;
why in its header): `nxdi_voxtral::row_linear` (x @ weight.T, the weight streamed once for all rows) and
`nxdi_voxtral::decode_attention` (one call for all query rows and heads).

The C kernels are compiled on first use with the host's C compiler (`$CC`, else cc) into the user cache, keyed by
the source, flags and compiler, and loaded with ctypes. Where they cannot be built or the CPU lacks AVX-512 (F,
BW, VL, BF16), each op runs its torch twin (`torch_row_linear`, `torch_decode_attention`): the same contract on
torch's own kernels, slower, and just as row-invariant on the host it runs on. The ops are registered with torch.library, so torch.export and
torch.compile see opaque nodes whose implementation is picked on the host that runs them.
NXDI_VOXTRAL_CPU_KERNELS=torch forces the torch twins.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# a verify pass of a batch has b x (K+1) <= 8 x 16 rows; more rows (prefill) take torch's fastest kernel
ROW_INVARIANT_ROWS = 128
TWIN_COLUMNS = 16  # the bf16 torch twin's one product shape
# False in a process that compiles the graphs for a Neuron device (the torchneuron backend, compiled.Target): the
# graphs then take the device branch (F.linear / SDPA, which the backend lowers) on every tensor, also on the CPU
# tensors of the rehearsal kit, where these opaque ops have no lowering
CPU_OPS = True


def use_cpu_ops(t: torch.Tensor, rows: int) -> bool:
    """Whether a pass of `rows` rows over tensor t runs on these row-invariant ops (else torch's own)."""
    return CPU_OPS and rows <= ROW_INVARIANT_ROWS and t.device.type == "cpu"

MAX_HEAD_DIM = 256  # as in the C source
SOURCE = Path(__file__).parent / "csrc" / "decode_kernels.c"
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fopenmp", "-shared", "-fPIC"]


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nxdi_voxtral" / "kernels"


def build(cc: str, out_dir: Path) -> Path:
    """Compile the kernels once per (source, flags, compiler); concurrent builders race to an atomic rename."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *CFLAGS, version]).encode()).hexdigest()[:16]
    target = out_dir / f"decode_kernels-{key}.so"
    if not target.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so")
        os.close(fd)
        try:
            subprocess.run([cc, *CFLAGS, "-o", tmp, str(SOURCE)], check=True, capture_output=True, text=True,
                           timeout=120)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


@functools.cache
def kernel_library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (with one log line saying why) where the torch twins have to serve."""
    if os.environ.get("NXDI_VOXTRAL_CPU_KERNELS", "native") == "torch":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: the CPU decode/verify ops run on torch's kernels (slower)")
        return None
    try:
        lib = ctypes.CDLL(str(build(cc, cache_dir())))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("could not build %s with %s (%s): the CPU decode/verify ops run on torch's kernels",
                    SOURCE.name, cc, detail.strip().splitlines()[-1] if detail.strip() else type(e).__name__)
        return None
    if not lib.kernels_supported():
        log.info("this CPU lacks AVX-512 (F, BW, VL, BF16): the CPU decode/verify ops run on torch's kernels")
        return None
    lib.row_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    lib.row_linear.restype = None
    lib.decode_attention.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_float]
                                     + [ctypes.c_int] * 2 + [ctypes.c_void_p])
    lib.decode_attention.restype = None
    return lib


def torch_row_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same contract on torch's kernels: every call has one fixed shape per dtype, because CPU BLAS picks its
    kernel and reduction order by shape (MKL fp32: one for 2-3 columns, another for >= 4, edge tiles for odd
    counts). fp32: weight @ [x_a, x_b].T pairs (two columns also avoid torch's single-threaded matrix-vector
    path); bf16: calls TWIN_COLUMNS columns wide, the last padded with copies of the last row (oneDNN's bf16
    product costs the same for 2 or 16 columns)."""
    rows = x.shape[0]
    if x.dtype == torch.bfloat16:
        blocks = [x[i:i + TWIN_COLUMNS] for i in range(0, rows, TWIN_COLUMNS)]
        blocks[-1] = torch.cat([blocks[-1], x[-1:].expand(TWIN_COLUMNS - blocks[-1].shape[0], -1)])
    else:
        blocks = [torch.stack([x[i], x[min(i + 1, rows - 1)]]) for i in range(0, rows, 2)]
    return torch.cat([(weight @ b.T).T for b in blocks])[:rows]


def row_linear_impl(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    lib = kernel_library()
    if lib is None or x.dtype not in (torch.float32, torch.bfloat16) or weight.dtype != x.dtype:
        return torch_row_linear(x, weight)
    x, weight = x.contiguous(), weight.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    lib.row_linear(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], weight.shape[0], weight.shape[1],
                   int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return y


def torch_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                           key_base: torch.Tensor) -> torch.Tensor:
    """The attention contract on torch's SDPA: one call per query row, [1, Hq, 1, D] contiguous, its own mask row
    and its sequence's keys gathered contiguous -- exactly the decode step's call (CPU SDPA takes another kernel for
    several queries or strided ones)."""
    b, hq, t, _ = q.shape
    s = visible.shape[-1]
    gqa = hq != k.shape[1]
    keys = [(k[:, :, base:base + s].contiguous(), v[:, :, base:base + s].contiguous()) for base in key_base.tolist()]
    out = [F.scaled_dot_product_attention(q[i:i + 1, :, r:r + 1].contiguous(), keys[i][0], keys[i][1],
                                          attn_mask=visible[i, r:r + 1], enable_gqa=gqa)[0, :, 0]
           for i in range(b) for r in range(t)]
    return torch.stack(out)


def decode_attention_impl(q, k, v, visible, key_base):
    lib = kernel_library()
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], visible.shape[-1]
    if (lib is None or q.dtype not in (torch.float32, torch.bfloat16) or not q.dtype == k.dtype == v.dtype
            or d > MAX_HEAD_DIM or hq % hkv or any(x.stride(3) != 1 or x.stride(2) != d for x in (k, v))):
        return torch_decode_attention(q, k, v, visible, key_base)
    q_rows = q.transpose(1, 2).reshape(b * t, hq, d).contiguous()  # [b*T, Hq, D]
    visible = visible.reshape(b * t, s).to(torch.uint8).contiguous()
    row_base = key_base.long().repeat_interleave(t).contiguous()
    out = torch.empty(b * t, hq, d, dtype=q.dtype)
    threads = torch.get_num_threads()
    scratch = torch.empty(threads, s, dtype=torch.float32)
    lib.decode_attention(q_rows.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), visible.data_ptr(),
                         row_base.data_ptr(), b * t, hq, hkv, d, s, k.stride(1), v.stride(1), 1.0 / math.sqrt(d),
                         int(q.dtype == torch.bfloat16), threads, scratch.data_ptr())
    return out


# torch.library.Library rather than the custom_op decorator: its dispatch adds no Python wrapper per call
# (a real-size decode step makes ~250 of these calls)
_lib = torch.library.Library("nxdi_voxtral", "DEF")
_lib.define("row_linear(Tensor x, Tensor weight) -> Tensor")
_lib.impl("row_linear", row_linear_impl, "CPU")
_lib.define("decode_attention(Tensor q, Tensor k, Tensor v, Tensor visible, Tensor key_base) -> Tensor")
_lib.impl("decode_attention", decode_attention_impl, "CPU")


@torch.library.register_fake("nxdi_voxtral::row_linear")
def _row_linear_fake(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.register_fake("nxdi_voxtral::decode_attention")
def _decode_attention_fake(q, k, v, visible, key_base):
    return q.new_empty(q.shape[0] * q.shape[2], q.shape[1], q.shape[3])


def row_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows <= ROW_INVARIANT_ROWS, in] @ weight[out, in].T on CPU; row j's bits do not depend on the rows."""
    return torch.ops.nxdi_voxtral.row_linear(x, weight)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                     key_base: torch.Tensor) -> torch.Tensor:
    """q [b, Hq, T, D]; k, v [1, Hkv, R, D] (rows contiguous, heads any stride); visible [b, T, S] bool; key_base
    [b] int -> [b*T, Hq, D]. Grouped-query attention on CPU: sequence i's queries read key rows key_base[i] ..
    key_base[i]+S-1 (its cache slot). A row's bits depend on neither the other rows nor S beyond what it sees."""
    return torch.ops.nxdi_voxtral.decode_attention(q, k, v, visible, key_base)
