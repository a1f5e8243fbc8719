"""`nxdi_voxtral::row_linear`: x @ weight.T for up to ROW_INVARIANT_ROWS rows on CPU, row-invariant and at memory
bandwidth (csrc/row_linear.c; why in its header).

The C kernel is compiled on first use with the host's C compiler (`$CC`, else cc) into the user cache, keyed by
the source and flags, and loaded with ctypes. Where it cannot be built or the CPU lacks AVX512-BF16, the op runs
`torch_row_linear`, the same contract on torch's own kernels (slower; just as row-invariant on the host it runs
on). The op is registered with torch.library, so torch.export and torch.compile see one opaque node whose
implementation is picked on the host that runs it. NXDI_VOXTRAL_CPU_LINEAR=torch forces the torch twin.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ROW_INVARIANT_ROWS = 16  # a verify pass has K+1 <= 16 rows; more rows (prefill) take torch's fastest kernel

SOURCE = Path(__file__).parent / "csrc" / "row_linear.c"
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mfma", "-fopenmp", "-shared", "-fPIC"]


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nxdi_voxtral" / "kernels"


def build(cc: str, out_dir: Path) -> Path:
    """Compile the kernel once per (source, flags, compiler); concurrent builders race to an atomic rename."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *CFLAGS, version]).encode()).hexdigest()[:16]
    target = out_dir / f"row_linear-{key}.so"
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
    """The loaded kernel, or None (with one log line saying why) where the torch twin has to serve."""
    if os.environ.get("NXDI_VOXTRAL_CPU_LINEAR", "kernel") == "torch":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: the CPU decode/verify linear runs on torch's kernels (slower)")
        return None
    try:
        lib = ctypes.CDLL(str(build(cc, cache_dir())))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("could not build %s with %s (%s): the CPU decode/verify linear runs on torch's kernels",
                    SOURCE.name, cc, detail.strip().splitlines()[-1] if detail.strip() else type(e).__name__)
        return None
    if not lib.row_linear_supported():
        log.info("this CPU lacks AVX512-BF16: the CPU decode/verify linear runs on torch's kernels")
        return None
    lib.row_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    lib.row_linear.restype = None
    return lib


def torch_row_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same contract on torch's kernels: every call has one fixed shape per dtype, because CPU BLAS picks its
    kernel and reduction order by shape (MKL fp32: one for 2-3 columns, another for >= 4, edge tiles for odd
    counts). fp32: weight @ [x_a, x_b].T pairs (two columns also avoid torch's single-threaded matrix-vector
    path); bf16: one call ROW_INVARIANT_ROWS columns wide padded with copies of the last row (oneDNN's bf16 product
    costs the same for 2 or 16 columns)."""
    rows = x.shape[0]
    if x.dtype == torch.bfloat16:
        blocks = [torch.cat([x, x[-1:].expand(ROW_INVARIANT_ROWS - rows, -1)])]
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


# torch.library.Library rather than the custom_op decorator: its dispatch adds no Python wrapper per call
# (a real-size decode step makes ~200 of these calls)
_lib = torch.library.Library("nxdi_voxtral", "DEF")
_lib.define("row_linear(Tensor x, Tensor weight) -> Tensor")
_lib.impl("row_linear", row_linear_impl, "CPU")


@torch.library.register_fake("nxdi_voxtral::row_linear")
def _row_linear_fake(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0])


def row_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows <= ROW_INVARIANT_ROWS, in] @ weight[out, in].T on CPU; row j's bits do not depend on the rows."""
    return torch.ops.nxdi_voxtral.row_linear(x, weight)
