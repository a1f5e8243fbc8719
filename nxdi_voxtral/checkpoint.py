"""Loading HF Voxtral checkpoints (model*.safetensors, sharded or not) into our module's parameter names."""
from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import CheckpointError

log = logging.getLogger(__name__)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index}: not valid JSON ({e})") from None
        except AttributeError:
            raise CheckpointError(f"{index}: expected a JSON object with a weight_map") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: no weight_map (tensor name -> shard file) in the index")
        names = sorted(set(weight_map.values()))
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shard files that do not exist: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no model*.safetensors files")
    return files


def read_safetensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in safetensors_files(Path(model_dir)):
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    out[k] = st.get_tensor(k)
        except Exception as e:  # safetensors raises its own error types for truncated / corrupt headers
            raise CheckpointError(f"{f}: cannot read safetensors file ({e})") from None
    return out


class StateDict(dict):
    """Our tensor names -> tensors, remembering each one's name in the checkpoint file (for error messages)."""

    def __init__(self, *args, source_keys: dict | None = None, **kw):
        super().__init__(*args, **kw)
        self.source_keys = source_keys or {}

    def file_key(self, key: str) -> str:
        """The checkpoint's name of `key`; for a missing key, its name in the layout the rest of the file uses."""
        if key in self.source_keys:
            return self.source_keys[key]
        theirs = set(self.source_keys.values())
        hub = any(k.startswith("language_model.model.") for k in theirs)
        v5 = any(k.startswith("model.language_model.") for k in theirs)
        if key.startswith("lm_head."):
            return "language_model." + key if hub else key
        if key.startswith("language_model."):
            return "language_model.model." + key[len("language_model."):] if hub else ("model." + key if v5 else key)
        return "model." + key if v5 else key


def convert_hf_to_neuron_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF key layouts -> our module names.

    transformers 4.5x / hub files: audio_tower.*, multi_modal_projector.*, language_model.model.*, language_model.lm_head.*
    transformers 5.x in memory:    model.audio_tower.*, model.multi_modal_projector.*, model.language_model.*, lm_head.*
    ours:                          audio_tower.*, multi_modal_projector.*, language_model.*, lm_head.*
    """
    out, source_keys = {}, {}
    for k, v in state_dict.items():
        original = k
        if k.startswith("model."):
            k = k[len("model."):]
        if k.startswith("language_model.lm_head."):
            k = k[len("language_model."):]
        elif k.startswith("language_model.model."):
            k = "language_model." + k[len("language_model.model."):]
        out[k] = v
        source_keys[k] = original
    return StateDict(out, source_keys=source_keys)


def check_and_cast(state_dict: dict[str, torch.Tensor], module: torch.nn.Module, dtype: torch.dtype,
                   source: str, shard=None) -> dict[str, torch.Tensor]:
    """Exactly the module's persistent tensors, with their shapes; a typed error names the first offender.
    shard(name, tensor) -> this rank's part: taken before the values are read (NaN / inf check, cast), so a rank
    touches only its own part of each tensor of a memory-mapped checkpoint."""
    expected = module.state_dict()
    name = state_dict.file_key if isinstance(state_dict, StateDict) else (lambda k: k)
    missing = [k for k in expected if k not in state_dict]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{source}: tensor {name(missing[0])!r} is missing{more}")
    for k, ref in expected.items():
        t = state_dict[k]
        if tuple(t.shape) != tuple(ref.shape):
            raise CheckpointError(f"{source}: tensor {name(k)!r} has shape {tuple(t.shape)}, expected "
                                  f"{tuple(ref.shape)}")
        if ref.is_floating_point() and not t.is_floating_point():
            raise CheckpointError(f"{source}: tensor {name(k)!r} has dtype {t.dtype}, expected floating point")
    out = {}
    for k, ref in expected.items():
        t = state_dict[k]
        if shard is not None:
            part = shard(k, t)
            if part is not t:
                release_file_pages(t)
            t = part
        if ref.is_floating_point() and not all_finite(t):
            raise CheckpointError(f"{source}: tensor {name(k)!r} contains NaN or infinite values")
        out[k] = t.to(dtype) if t.is_floating_point() else t
    unused = sorted(set(state_dict) - set(expected))
    if unused:
        log.warning("%s: ignoring %d tensors the model does not use (first: %s)", source, len(unused), unused[0])
    return out


def release_file_pages(t: torch.Tensor) -> None:
    """Drop a memory-mapped checkpoint tensor's pages from this process (they stay in the page cache; a later read
    faults them back in from the file), so a rank that copied out its shard does not also count the pages it read.
    Only for tensors inside a mapping of a .safetensors file (safetensors maps them private, copy-on-write; the
    loader never writes to them): on anonymous memory MADV_DONTNEED would zero the data."""
    if t.device.type != "cpu" or t.numel() == 0 or not hasattr(os, "sysconf") or not Path("/proc/self/maps").exists():
        return
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= start and end <= hi:
            if len(fields) < 6 or not fields[5].endswith(".safetensors"):
                return
            page = os.sysconf("SC_PAGE_SIZE")
            first, last = -(-start // page) * page, end // page * page  # whole pages inside the tensor only
            if last > first:
                ctypes.CDLL(None).madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), 4)  # MADV_DONTNEED
            return


def all_finite(t: torch.Tensor, chunk: int = 1 << 24) -> bool:
    """Cheap: one sum per tensor (NaN / inf propagate); only a non-finite sum, which a finite tensor of huge values
    could also give, is checked element-wise, in chunks so no tensor-sized mask is allocated."""
    if torch.isfinite(t.sum()):  # accumulates in fp32 for bf16 / fp16 (an fp16 overflow falls to the exact path)
        return True
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + chunk]).all()) for i in range(0, flat.numel(), chunk))


def build_and_load(factory, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, source: str,
                   tp: int = 1, rank: int = 0, comm=None):
    """factory(comm) builds the module; its structure is the same on every rank. Checks the checkpoint against the
    whole (tp=1) module, takes this rank's shards (its SPMDRank weights included) and assigns them without a second
    copy of the weights; caches are then allocated."""
    import dataclasses
    from .tp import SINGLE, shard_kind, shard_tensor
    with torch.device("meta"):
        whole = factory(SINGLE)
        local = whole if tp == 1 else factory(comm)
    if tp == 1:
        sd = check_and_cast(state_dict, whole, dtype, source)
    else:
        lay = dataclasses.replace(local.layout, rank=rank)
        sd = check_and_cast(state_dict, whole, dtype, source, shard=lambda k, v: shard_tensor(k, v, lay))
        sd.update({k: shard_tensor(k, torch.arange(tp, dtype=torch.int32), lay) for k in local.state_dict()
                   if shard_kind(k, lay) == "rank"})
    local.load_state_dict(sd, strict=True, assign=True)
    local.init_state("cpu", dtype)
    return local.eval()
