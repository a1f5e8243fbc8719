"""On a trn2 host with Neuron SDK >= 2.34 (TorchNeuron: torch-neuronx registering the `neuron` device): build a
tiny config with `compile.build --backend torchneuron` at tp 1 and 2, load each release in a fresh dynamo state
(`from_artifacts` refuses a graph that compiles to a NEFF the release does not hold, so loading compiles nothing
new), check tokens against the CPU eager backend for every draft kind, and print a latency table. Not collected off
Neuron hosts (what runs here instead: tests/rehearsal_torchneuron, in ../shared/torchneuron-rehearsal).

    python -m pytest -q -s tests/neuron/test_torchneuron_device.py
"""
import time

import pytest
import torch

from nxdi_voxtral.compiled import torchneuron_available

if not torchneuron_available():
    pytest.skip("needs TorchNeuron and a Neuron device (SDK >= 2.34)", allow_module_level=True)

from nxdi_voxtral import NxDVoxtralSpecDec  # noqa: E402
from nxdi_voxtral.build import build  # noqa: E402
from nxdi_voxtral.compiled import summary  # noqa: E402

from conftest import SMALL_BUCKETS  # noqa: E402
from parity import print_latency, tokens_and_latency  # noqa: E402

KINDS = [(None, None), ("layers", "layers_high"), ("dflash", "dflash"), ("ngram", None)]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind,draft", KINDS, ids=[str(k) for k, _ in KINDS])
def test_release_round_trip_generates_the_cpu_tokens(kind, draft, tp, spec_dirs, tmp_path):
    draft_dir = spec_dirs.get(draft) if draft else None
    out = tmp_path / "rel"
    t0 = time.perf_counter()
    build(spec_dirs["target"], out, draft=draft_dir, draft_kind=kind, tp=tp, buckets=SMALL_BUCKETS,
          backend="torchneuron")
    build_s = time.perf_counter() - t0
    cpu = NxDVoxtralSpecDec.from_pretrained(spec_dirs["target"], draft=draft_dir, draft_kind=kind,
                                            buckets=SMALL_BUCKETS)
    torch._dynamo.reset()  # as a fresh serving process
    t0 = time.perf_counter()
    with NxDVoxtralSpecDec.from_artifacts(out) as dev:
        load_s = time.perf_counter() - t0
        rows = tokens_and_latency(cpu, dev, f"{kind} tp {tp}")
        s = summary(dev.compile_stats)
    print_latency(f"{kind or 'plain'} tp {tp}: build {build_s:.0f} s, load {load_s:.1f} s ({s['graphs']} graphs)",
                  rows)
