"""The kernel entry points the graphs call: plain torch callables, NKI kernel or torch twin behind one switch.

Contracts (identical for both implementations; integer outputs bit-exact between them):
  splice(embeds [T+1, H], audio [A, H], positions [A] int32) -> [T+1, H]  (embeds' dtype; audio same dtype)
      embeds with row positions[i] replaced by audio[i]; row T is the scratch row that padding entries point
      at (the caller drops it); real positions unique in [0, T). Twin: embeds.index_copy(0, positions, audio).
  greedy_verify(candidates [B, K+1] int32, logits [B, K+1, V] fp32|bf16, n_valid [B] int32)
      -> (target_tokens [B, K+1] int32, accepted [B] int32, bonus [B] int32)       (kernels/verify_ref.py)
  greedy_accept(candidates [B, K+1] int32, target_tokens [B, K+1] int32, n_valid [B] int32)
      -> (target_tokens, accepted [B] int32, bonus [B] int32)   the accept half, after a TP argmax combine
  rank_argmax(logits [..., V_local] fp32|bf16) -> (max_values [...] logits' dtype, first_index [...] int32)
      first_index = torch.argmax(logits, -1) (lowest index among equal maxima) on this rank's shard.
  combine_rank_argmax(values [tp, ...], indices [tp, ...] int32, shard_size) -> global ids [...] int32
      the cross-rank step (always torch): largest value, lowest rank on ties; equals torch.argmax over the
      full vocabulary.

The switch: NXDI_VOXTRAL_KERNELS=torch (default: CPU, torch-xla CPU rehearsal, everywhere) | nki.
`kernel_impl()` returns the current choice (compile.build records it in the manifest).
With "nki":
  - XLA tensors (torch-neuronx / torch-xla, SDK <= 2.31): the @nki.jit kernel is called on the XLA tensors
    inside the traced graph, which lowers it to a custom call compiled into the same NEFF.
  - "neuron" tensors (TorchNeuron, SDK >= 2.32): the kernel runs through a custom op registered once with
    torch_neuronx's `nki_op` (torch.library.custom_op underneath), so eager and torch.compile see one op.
  - CPU tensors: nki.simulate(kernel) when the real `nki` package imports (a trn2 host without a device).
  - NkiUnavailableError (a ConfigError) when `nki` cannot be imported; `nki` is imported only here, lazily.
The twins create every tensor with device= from an input and use no .item(), sort, nonzero, boolean indexing
or int32 cumprod, so they trace on XLA.
"""
from __future__ import annotations

import os

import torch

from .nki_api import KernelArgumentError, NkiUnavailableError, import_nki
from .rank_argmax import check_vocab, combine_rank_argmax, rank_argmax_kernel, rank_argmax_torch
from .splice import check_splice_args, splice_kernel, splice_torch
from .verify import (check_verify_args, greedy_accept_kernel, greedy_accept_torch, greedy_verify_kernel,
                            greedy_verify_torch)
from nxdi_voxtral.errors import ConfigError

ENV = "NXDI_VOXTRAL_KERNELS"
IMPLEMENTATIONS = ("torch", "nki")

__all__ = ["ENV", "IMPLEMENTATIONS", "kernel_impl", "splice", "greedy_verify", "greedy_accept", "rank_argmax",
           "combine_rank_argmax", "KernelArgumentError", "NkiUnavailableError"]


def kernel_impl() -> str:
    """'torch' or 'nki', from NXDI_VOXTRAL_KERNELS (read at every call; default 'torch')."""
    impl = os.environ.get(ENV, "torch").strip().lower() or "torch"
    if impl not in IMPLEMENTATIONS:
        raise ConfigError(f"{ENV}={impl!r}: expected one of {IMPLEMENTATIONS}")
    return impl


def _tracing() -> bool:
    try:
        return bool(torch.compiler.is_compiling())
    except Exception:
        return False


# ------------------------------------------------------------------------------------------- NKI path
_TORCHNEURON_OPS: dict = {}


def _torchneuron_ops() -> dict:
    """Custom ops for TorchNeuron, registered once: each kernel wrapped by torch_neuronx's `nki_op` (a
    torch.library custom op underneath, the form the backend lowers), jitted by the SDK's `nki`. The backend source
    exports `nki_op` / `wrap_nki` at the top of torch_neuronx (no `torch_neuronx.nki`). Not run: the rehearsal kit
    stubs `nki_op`, and there is no Neuron device here."""
    if _TORCHNEURON_OPS:
        return _TORCHNEURON_OPS
    try:
        from torch_neuronx import nki_op
    except ImportError as e:
        raise NkiUnavailableError(f"'neuron' tensors need torch_neuronx (TorchNeuron, SDK >= 2.34): {e}") from e
    jit = import_nki()[0].jit

    @nki_op("nxdi_voxtral::splice", mutates_args={})
    def splice_op(embeds: torch.Tensor, audio: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return splice_kernel.real(jit)(embeds, audio, positions)

    @nki_op("nxdi_voxtral::greedy_verify", mutates_args={})
    def verify_op(candidates: torch.Tensor, logits: torch.Tensor,
                  n_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(greedy_verify_kernel.real(jit)(candidates, logits, n_valid))

    @nki_op("nxdi_voxtral::greedy_accept", mutates_args={})
    def accept_op(candidates: torch.Tensor, target: torch.Tensor,
                  n_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(greedy_accept_kernel.real(jit)(candidates, target, n_valid))

    @nki_op("nxdi_voxtral::rank_argmax", mutates_args={})
    def argmax_op(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(rank_argmax_kernel.real(jit)(logits))

    _TORCHNEURON_OPS.update(splice=splice_op, greedy_verify=verify_op, greedy_accept=accept_op,
                            rank_argmax=argmax_op)
    return _TORCHNEURON_OPS


def _run_nki(name: str, handle, *args):
    import_nki()  # NkiUnavailableError when the SDK's package is missing
    device = args[0].device.type
    if device == "xla":
        return handle(*args)
    if device == "neuron":
        return _torchneuron_ops()[name](*args)
    if device == "cpu":
        nki_mod = import_nki()[0]
        return nki_mod.simulate(handle.real())(*args)
    raise NkiUnavailableError(f"NKI kernels run on XLA ('xla') or TorchNeuron ('neuron') tensors, not {device!r}")


# ---------------------------------------------------------------------------------------- entry points
def splice(embeds: torch.Tensor, audio: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    if kernel_impl() == "torch":
        return splice_torch(embeds, audio, positions)
    check_splice_args(embeds, audio, positions, values=positions.device.type == "cpu" and not _tracing())
    if audio.shape[0] == 0:
        return embeds.clone()
    return _run_nki("splice", splice_kernel, embeds, audio, positions)


def greedy_verify(candidates: torch.Tensor, logits: torch.Tensor, n_valid: torch.Tensor):
    if kernel_impl() == "torch":
        return greedy_verify_torch(candidates, logits, n_valid)
    check_verify_args(candidates, logits, n_valid)
    return tuple(_run_nki("greedy_verify", greedy_verify_kernel, candidates, logits, n_valid))


def greedy_accept(candidates: torch.Tensor, target_tokens: torch.Tensor, n_valid: torch.Tensor):
    if kernel_impl() == "torch":
        return greedy_accept_torch(candidates, target_tokens, n_valid)
    check_verify_args(candidates, None, n_valid, target=target_tokens)
    accepted, bonus = _run_nki("greedy_accept", greedy_accept_kernel, candidates, target_tokens, n_valid)
    return target_tokens, accepted, bonus


def rank_argmax(logits: torch.Tensor):
    if kernel_impl() == "torch":
        return rank_argmax_torch(logits)
    if logits.dtype not in (torch.float32, torch.bfloat16):
        raise KernelArgumentError(f"rank_argmax: logits must be float32 or bfloat16, got {logits.dtype}")
    lead, vocab = tuple(logits.shape[:-1]), logits.shape[-1]
    check_vocab(vocab)
    values, index = _run_nki("rank_argmax", rank_argmax_kernel, logits.reshape(-1, vocab))
    return values.reshape(lead), index.reshape(lead)
