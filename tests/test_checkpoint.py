"""Checkpoint loading: HF layouts, sharding, typed errors naming the tensor."""
import os
import json

import pytest
from safetensors.torch import load_file, save_file

from nxdi_voxtral import CheckpointError, NxDVoxtralSpecDec
from nxdi_voxtral.synthetic import write_tokenizer

from conftest import SMALL_BUCKETS, noise


def copy_ckpt(src, dst, mutate=None):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    (dst / "tekken.json").write_text((src / "tekken.json").read_text())
    sd = load_file(str(src / "model.safetensors"))
    if mutate:
        sd = mutate(sd)
    save_file(sd, str(dst / "model.safetensors"))
    return dst


def tokens(model_dir, seconds=3.0):
    m = NxDVoxtralSpecDec.from_pretrained(model_dir, buckets=SMALL_BUCKETS)
    p = m.prepare(noise(seconds), sampling_rate=16000)
    return m.generate(p.input_ids, p.input_features, max_new_tokens=10)[0].tolist()


def test_sharded_checkpoint_with_index_loads_the_same(ckpt_factory, tiny_dir):
    assert (ckpt_factory(shards=3) / "model.safetensors.index.json").is_file()
    assert tokens(ckpt_factory(shards=3)) == tokens(tiny_dir)


def test_transformers_5_in_memory_layout_is_accepted(tiny_dir, tmp_path):
    """Keys as transformers 5.x names them in memory (model.language_model.layers..., lm_head...)."""
    from transformers import VoxtralForConditionalGeneration
    hf = VoxtralForConditionalGeneration.from_pretrained(tiny_dir)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.startswith("model.language_model.layers.") for k in sd)
    d = copy_ckpt(tiny_dir, tmp_path / "v5", mutate=lambda _: sd)
    assert tokens(d) == tokens(tiny_dir)


def test_transformers_save_pretrained_output_loads(tiny_dir, tmp_path):
    from transformers import VoxtralForConditionalGeneration
    hf = VoxtralForConditionalGeneration.from_pretrained(tiny_dir)
    hf.save_pretrained(tmp_path / "saved")
    write_tokenizer(tmp_path / "saved", hf.config.text_config.vocab_size)
    assert tokens(tmp_path / "saved") == tokens(tiny_dir)


def test_missing_tensor_is_named(tiny_dir, tmp_path):
    key = "language_model.model.layers.1.mlp.down_proj.weight"
    d = copy_ckpt(tiny_dir, tmp_path / "m", mutate=lambda sd: {k: v for k, v in sd.items() if k != key})
    with pytest.raises(CheckpointError, match=rf"'{key}' is missing"):  # the checkpoint's name (issue 13)
        NxDVoxtralSpecDec.from_pretrained(d, buckets=SMALL_BUCKETS)


def test_misshaped_tensor_is_named(tiny_dir, tmp_path):
    key = "multi_modal_projector.linear_1.weight"
    d = copy_ckpt(tiny_dir, tmp_path / "m", mutate=lambda sd: {**sd, key: sd[key][:, :-1].contiguous()})
    with pytest.raises(CheckpointError, match=r"'multi_modal_projector.linear_1.weight' has shape \(64, 127\)"):
        NxDVoxtralSpecDec.from_pretrained(d, buckets=SMALL_BUCKETS)


def test_missing_files_and_corrupt_weights(tiny_dir, tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        NxDVoxtralSpecDec.from_pretrained(tmp_path)
    d = copy_ckpt(tiny_dir, tmp_path / "c")
    (d / "tekken.json").unlink()
    with pytest.raises(CheckpointError, match="no tekken.json"):
        NxDVoxtralSpecDec.from_pretrained(d, buckets=SMALL_BUCKETS)
    d = copy_ckpt(tiny_dir, tmp_path / "t")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cannot read safetensors"):
        NxDVoxtralSpecDec.from_pretrained(d, buckets=SMALL_BUCKETS)
    d = copy_ckpt(tiny_dir, tmp_path / "j")
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        NxDVoxtralSpecDec.from_pretrained(d, buckets=SMALL_BUCKETS)
    d = copy_ckpt(tiny_dir, tmp_path / "i")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00009.safetensors"}}))
    with pytest.raises(CheckpointError, match="do not exist"):
        NxDVoxtralSpecDec.from_pretrained(d, buckets=SMALL_BUCKETS)


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_released_checkpoint_pages_leave_rss_and_read_back_the_same(tmp_path):
    import torch
    from nxdi_voxtral.checkpoint import read_safetensors, release_file_pages
    save_file({"w": torch.arange(32 * 2**20 // 4, dtype=torch.float32).reshape(2048, -1)}, tmp_path / "model.safetensors")
    w = read_safetensors(tmp_path)["w"]
    total = float(w.sum())
    before = resident_mib()
    release_file_pages(w)
    assert resident_mib() < before - 24  # the 32 MiB mapping left this process
    assert float(w.sum()) == total  # faulted back in from the file


def test_release_leaves_anonymous_memory_alone():
    import torch
    from nxdi_voxtral.checkpoint import release_file_pages
    w = torch.arange(4 * 2**20, dtype=torch.float32)
    release_file_pages(w)  # MADV_DONTNEED here would zero it
    assert torch.equal(w, torch.arange(4 * 2**20, dtype=torch.float32))


def test_a_rank_reads_only_its_shards(tiny_dir, monkeypatch):
    """At tp 2 every sharded tensor is cut before its values are read, and the whole tensor's pages released."""
    import torch
    from nxdi_voxtral import Buckets, checkpoint
    from nxdi_voxtral.config import VoxtralConfig
    from nxdi_voxtral.engine import load_voxtral
    from nxdi_voxtral.tp import DistComm
    read, released = [], []
    monkeypatch.setattr(checkpoint, "all_finite", lambda t: read.append(t.numel()) or True)
    monkeypatch.setattr(checkpoint, "release_file_pages", lambda t: released.append(t.numel()))
    sd = checkpoint.convert_hf_to_neuron_state_dict(checkpoint.read_safetensors(tiny_dir))
    whole = sum(v.numel() for v in sd.values() if v.is_floating_point())
    load_voxtral(tiny_dir, sd, VoxtralConfig.from_dir(tiny_dir), torch.float32, Buckets(audio_chunks=(1,),
                 kv_lengths=(64,)), tp=2, rank=1, comm=DistComm(1, 2))
    assert sum(released) > 0.75 * whole  # every sharded tensor; norms, convs, positions are replicated
    assert sum(read) == whole - sum(released) // 2  # replicated tensors whole, sharded ones half
