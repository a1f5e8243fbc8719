"""kernels/ops.py: the one switch, typed errors on the NKI path without the SDK, and XLA-traceable twins."""
import importlib.util
import sys

import pytest
import torch

from nxdi_voxtral.kernels import ops
from nxdi_voxtral.kernels.nki_api import KernelArgumentError, NkiUnavailableError
from nxdi_voxtral.kernels.splice import check_splice_args
from nxdi_voxtral.contract import BANNED_OPS, OpRecorder
from nxdi_voxtral.errors import ConfigError


def inputs(device="cpu"):
    g = torch.Generator().manual_seed(0)
    b, k1, v = 2, 5, 300
    logits = torch.randn(b, k1, v, generator=g)
    target = torch.argmax(logits, -1).int()
    cand = torch.cat([torch.zeros(b, 1, dtype=torch.int32), target[:, :-1]], 1)
    n_valid = torch.tensor([4, 2], dtype=torch.int32)
    embeds, audio = torch.randn(10, 8, generator=g), torch.randn(3, 8, generator=g)
    positions = torch.tensor([2, 5, 9], dtype=torch.int32)
    calls = {
        "splice": (embeds, audio, positions),
        "greedy_verify": (cand, logits, n_valid),
        "greedy_accept": (cand, target, n_valid),
        "rank_argmax": (logits,),
    }
    return {k: tuple(t.to(device) for t in a) for k, a in calls.items()}


def test_switch_default_and_values(monkeypatch):
    monkeypatch.delenv(ops.ENV, raising=False)
    assert ops.kernel_impl() == "torch"
    monkeypatch.setenv(ops.ENV, "NKI")
    assert ops.kernel_impl() == "nki"
    monkeypatch.setenv(ops.ENV, "cuda")
    with pytest.raises(ConfigError, match="NXDI_VOXTRAL_KERNELS"):
        ops.kernel_impl()


def test_torch_path_is_the_twin(monkeypatch):
    monkeypatch.setenv(ops.ENV, "torch")
    c = inputs()
    out = ops.splice(*c["splice"])
    assert torch.equal(out, c["splice"][0].index_copy(0, c["splice"][2].long(), c["splice"][1]))
    t, a, b = ops.greedy_verify(*c["greedy_verify"])
    assert torch.equal(t, torch.argmax(c["greedy_verify"][1], -1).int()) and a.tolist() == [4, 2]
    t2, a2, b2 = ops.greedy_accept(*c["greedy_accept"])
    assert torch.equal(a2, a) and torch.equal(b2, b)
    v, i = ops.rank_argmax(c["rank_argmax"][0])
    assert i.dtype == torch.int32 and torch.equal(v, c["rank_argmax"][0].max(-1).values)


def test_nki_path_without_sdk_raises_typed_error(monkeypatch):
    if "nki" in sys.modules:
        pytest.skip("an `nki` module is importable here")
    monkeypatch.setenv(ops.ENV, "nki")
    for name, args in inputs().items():
        with pytest.raises(NkiUnavailableError, match="Neuron pip repository") as e:
            getattr(ops, name)(*args)
        assert isinstance(e.value, ConfigError)
    assert "nki" not in sys.modules  # nothing imported the placeholder for good


def test_nki_path_checks_arguments_on_the_host(monkeypatch):
    monkeypatch.setenv(ops.ENV, "nki")
    c = inputs()
    embeds, audio, positions = c["splice"]
    with pytest.raises(KernelArgumentError, match="int32"):
        ops.splice(embeds, audio, positions.long())
    with pytest.raises(KernelArgumentError, match=r"\[0, 9\]"):
        ops.splice(embeds, audio, torch.tensor([2, 5, 10], dtype=torch.int32))
    with pytest.raises(KernelArgumentError, match="unique"):
        ops.splice(embeds, audio, torch.tensor([2, 2, 9], dtype=torch.int32))
    check_splice_args(embeds, audio, torch.tensor([2, 9, 9], dtype=torch.int32), values=True)  # padding shares T
    cand, logits, n_valid = c["greedy_verify"]
    with pytest.raises(KernelArgumentError, match="float32 or bfloat16"):
        ops.greedy_verify(cand, logits.half(), n_valid)
    with pytest.raises(KernelArgumentError, match="n_valid"):
        ops.greedy_verify(cand, logits, n_valid.long())


@pytest.mark.parametrize("name", ["splice", "greedy_verify", "greedy_accept", "rank_argmax"])
def test_twins_trace_on_a_device_without_host_values(monkeypatch, name):
    """On 'meta' every tensor created without device= from an input, every .item() and every host read fails:
    the same mistakes that break a torch-xla trace. Banned ops and int32 cumprod are caught by recording."""
    monkeypatch.setenv(ops.ENV, "torch")
    args = inputs("meta")[name]
    rec = OpRecorder()
    with rec:
        out = getattr(ops, name)(*args)
    outs = out if isinstance(out, tuple) else (out,)
    assert all(o.device.type == "meta" for o in outs)
    assert not set(rec.ops) & (BANNED_OPS | {"cumprod"}) and not rec.bool_indexing
    assert all(o.dtype != torch.int64 for o in outs)


def twins_lower_on_torch_xla_without_fallbacks(monkeypatch):
    """In ../shared/neuron-rehearsal (torch-xla CPU): each twin lowers to one HLO graph, no aten fallback."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    monkeypatch.setenv(ops.ENV, "torch")
    dev = xm.xla_device()
    for name, args in inputs().items():
        met.clear_all()
        out = getattr(ops, name)(*(a.to(dev) for a in args))
        outs = out if isinstance(out, tuple) else (out,)
        assert torch_xla._XLAC._get_xla_tensors_hlo(list(outs))
        ref = getattr(ops, name)(*args)
        assert all(torch.equal(o.cpu(), r) for o, r in zip(outs, ref if isinstance(ref, tuple) else (ref,)))
        assert met.executed_fallback_ops() == [], (name, met.executed_fallback_ops())
    monkeypatch.setenv(ops.ENV, "nki")  # the kit's stub `nki` is refused, not traced into a meaningless graph
    with pytest.raises(NkiUnavailableError):
        ops.rank_argmax(inputs()["rank_argmax"][0].to(dev))


if importlib.util.find_spec("torch_xla") is not None:  # collected in the rehearsal venv only (`.ci/run`)
    test_twins_lower_on_torch_xla_without_fallbacks = twins_lower_on_torch_xla_without_fallbacks
