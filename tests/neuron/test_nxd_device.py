"""On a trn2 host with the Neuron SDK 2.29-2.31 (torch-neuronx, neuronx-cc, NxD): compile a tiny config at tp 2
with `compile.build --backend neuron`, load it with `from_artifacts`, check tokens against the CPU backend for every
draft kind, and print a latency table. Skipped off Neuron hosts (what runs here instead: tests/rehearsal).

    python -m pytest -q -s tests/neuron/test_nxd_device.py
"""
import os
import time

import pytest

torch_neuronx = pytest.importorskip("torch_neuronx", reason="needs torch-neuronx (a trn2 host, SDK <= 2.31)")
if not os.path.exists("/dev/neuron0") or not hasattr(torch_neuronx, "xla_impl"):
    pytest.skip("needs a Neuron device (/dev/neuron0) and the real torch-neuronx", allow_module_level=True)

from nxdi_voxtral.build import build  # noqa: E402
from nxdi_voxtral import NxDVoxtralSpecDec  # noqa: E402

from conftest import SMALL_BUCKETS  # noqa: E402
from parity import print_latency, tokens_and_latency  # noqa: E402

KINDS = [(None, None), ("layers", "layers_high"), ("dflash", "dflash"), ("ngram", None)]


@pytest.mark.parametrize("kind,draft", KINDS, ids=[str(k) for k, _ in KINDS])
def test_tp2_neffs_generate_the_cpu_tokens(kind, draft, spec_dirs, tmp_path):
    draft_dir = spec_dirs.get(draft) if draft else None
    out = tmp_path / "art"
    t0 = time.perf_counter()
    build(spec_dirs["target"], out, draft=draft_dir, draft_kind=kind, tp=2, buckets=SMALL_BUCKETS, backend="nxd")
    compile_s = time.perf_counter() - t0
    cpu = NxDVoxtralSpecDec.from_pretrained(spec_dirs["target"], draft=draft_dir, draft_kind=kind,
                                            buckets=SMALL_BUCKETS)
    dev = NxDVoxtralSpecDec.from_artifacts(out)
    print_latency(f"{kind or 'plain'}: compile {compile_s:.0f} s", tokens_and_latency(cpu, dev, str(kind)))
