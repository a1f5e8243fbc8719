"""Where the kernel files get `nki`, `nl` and `nisa` from, without importing the Neuron SDK at import time.

Every kernel file starts with `from .nki_api import nki, nl, nisa` and is then written against the real
NKI 0.6 API (`@nki.jit`, `nl.ndarray`, dst-first `nisa.*`). The three names are lazy stand-ins:

- Importing a kernel file (and its torch twin) never imports `nki`: `nki.jit(fn)` only wraps `fn` in a
  `KernelHandle`.
- The first call of a handle (`kernel(...)`, `kernel[lnc](...)`) imports the real package, rebinds the kernel
  function (and the helper functions it reaches through module globals) to the real `nki`, `nki.language`,
  `nki.isa` modules, and applies the real `nki.jit` to it. The real compiler therefore sees real modules, not
  these stand-ins. When the package cannot be imported (CPU hosts; PyPI's `nki` is a placeholder that raises
  "WRONG PACKAGE") the call raises `NkiUnavailableError`, a `ConfigError`.
- `kernels.nki_interp` runs the same function objects with its NumPy interpreter by the same rebinding
  (`rebind(fn, {...})`): nothing is put into `sys.modules`.
"""
from __future__ import annotations

import importlib
import types

from nxdi_voxtral.errors import ConfigError


class KernelArgumentError(ConfigError):
    """Arguments a kernel entry point refuses on the host (shape, dtype, index range) before any device work."""


class NkiUnavailableError(ConfigError):
    """The NKI implementation was selected but the real `nki` package (Neuron SDK >= 2.27) cannot be imported."""


def import_nki():
    """The real (nki, nki.language, nki.isa) modules, or NkiUnavailableError naming why not."""
    try:
        mods = tuple(importlib.import_module(m) for m in ("nki", "nki.language", "nki.isa"))
    except Exception as e:  # ImportError, or the PyPI placeholder's "WRONG PACKAGE" error
        raise NkiUnavailableError(
            f"NXDI_VOXTRAL_KERNELS=nki needs the `nki` package from AWS's Neuron pip repository (SDK >= 2.27); "
            f"importing it failed: {type(e).__name__}: {e}") from e
    if getattr(mods[0], "IS_STUB", False) is True:
        raise NkiUnavailableError("`nki` is the neuron-rehearsal kit's stub (nothing compiles there): run with "
                                  "NXDI_VOXTRAL_KERNELS=torch, or on a host with the Neuron SDK's `nki`")
    if not hasattr(mods[0], "jit"):
        raise NkiUnavailableError(f"`nki` imported from {getattr(mods[0], '__file__', '?')} has no `jit`: "
                                  "not the Neuron SDK's package")
    return mods


class _LazyModule(types.ModuleType):
    """Attribute access forwards to the real module (imported on first use)."""

    def __init__(self, name: str, index: int):
        super().__init__(name, f"lazy stand-in for `{name}` (kernels/nki_api.py)")
        self._index = index

    def __getattr__(self, attr):
        if attr.startswith("_"):  # introspection (pytest, inspect, copy) must not import the SDK
            raise AttributeError(attr)
        return getattr(import_nki()[self._index], attr)


class KernelHandle:
    """`@nki.jit` applied lazily. `fn` is the undecorated kernel function."""

    def __init__(self, fn, jit_kwargs: dict):
        self.fn = fn
        self.jit_kwargs = jit_kwargs
        self._real = {}
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__wrapped__ = fn

    def real(self, jit=None):
        """The kernel jitted by the real NKI; `jit` picks another decorator (TorchNeuron's torch_neuronx.nki.jit)."""
        key = id(jit)
        if key not in self._real:
            real_nki, real_nl, real_nisa = import_nki()
            fn = rebind(self.fn, {nki: real_nki, nl: real_nl, nisa: real_nisa})
            self._real[key] = (jit or real_nki.jit)(fn, **self.jit_kwargs)
        return self._real[key]

    def __call__(self, *args, **kwargs):
        return self.real()(*args, **kwargs)

    def __getitem__(self, grid):
        return self.real()[grid]

    def __repr__(self):
        return f"<KernelHandle {self.__name__} (nki.jit applied on first call)>"


class _LazyNki(_LazyModule):
    def jit(self, fn=None, **kwargs):
        if fn is None:
            return lambda f: KernelHandle(f, kwargs)
        return KernelHandle(fn, kwargs)


nki = _LazyNki("nki", 0)
nl = _LazyModule("nki.language", 1)
nisa = _LazyModule("nki.isa", 2)
STAND_INS = (nki, nl, nisa)


def _refers_to_stand_ins(g: dict) -> bool:
    return any(v is s for v in g.values() for s in STAND_INS)


def rebind(fn, subst: dict, _memo: dict | None = None):
    """A copy of `fn` whose module globals have each stand-in module replaced by `subst[stand_in]`; functions
    reached through those globals that also use the stand-ins (helpers, in any kernels module) are rebound too.
    The original module is not modified."""
    if isinstance(fn, KernelHandle):
        fn = fn.fn
    memo = {} if _memo is None else _memo
    g = fn.__globals__
    if id(g) not in memo:
        new = dict(g)
        memo[id(g)] = new
        for k, v in g.items():
            hit = [subst[s] for s in subst if v is s]
            if hit:
                new[k] = hit[0]
            elif isinstance(v, types.FunctionType) and _refers_to_stand_ins(v.__globals__):
                new[k] = rebind(v, subst, memo)
    out = types.FunctionType(fn.__code__, memo[id(g)], fn.__name__, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__qualname__, out.__doc__, out.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    return out
