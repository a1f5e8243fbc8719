"""Tensor parallelism on CPU: tp in {1, 2, 4} on the mid-size model (decoder 1024 x 8 layers, vocab 32768):
decode time per token, per-rank weight bytes vs the ideal total/tp, identical tokens; and compile.build time per
graph for the same model (CPU backend: contract check + torch.export).

    python -m benchmarks.tp        (~3 min on 2 cores; ranks share the 2 cores, so tp > 2 cannot be faster here)
"""
from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table, median, mid_checkpoint, test_audio


def main() -> None:
    from nxdi_voxtral import Buckets, NxDVoxtralSpecDec
    from nxdi_voxtral.engine import build_engine
    from nxdi_voxtral.build import build
    d = mid_checkpoint()
    buckets = Buckets(audio_chunks=(1,), kv_lengths=(512,))
    total = build_engine(d, buckets=buckets).weight_bytes()
    rows, ref = [], None
    for tp in (1, 2, 4):
        with NxDVoxtralSpecDec.from_pretrained(d, buckets=buckets, tp_degree=tp) as m:
            p = m.prepare(test_audio(30.0), language="en", sampling_rate=16000)
            per_rank = m.ranks.call("weight_bytes")
            times = []
            for _ in range(2):
                t = {}
                ids = m.generate(p.input_ids, p.input_features, max_new_tokens=48, timings=t)[0].tolist()
                times.append(t["decode_s"] / (len(ids) - 1))
            ref = ref or ids
            rows.append([tp, 1e3 * median(times), max(per_rank) / 2**20, total / tp / 2**20,
                         max(per_rank) / (total / tp), "yes" if ids == ref else "NO"])
    print(markdown_table(["tp", "ms/token", "weights per rank MiB (max)", "total/tp MiB", "ratio", "same tokens"],
                         rows))
    out = Path(tempfile.mkdtemp()) / "art"
    t0 = time.perf_counter()
    manifest = build(d, out, tp=1, buckets=Buckets(audio_chunks=(1, 2), kv_lengths=(512, 1024)), backend="export")
    print()
    print(markdown_table(["graph", "bucket", "build s (check + export)"],
                         [[g["tag"], g["bucket"], g["seconds"]] for g in manifest["graphs"]]))
    print(f"compile.build total {time.perf_counter() - t0:.1f} s")
    shutil.rmtree(out.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
