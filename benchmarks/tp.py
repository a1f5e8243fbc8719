"""Tensor parallelism on CPU: tp in {1, 2, 4} on the mid-size model (decoder 1024 x 8 layers, vocab 32768):
decode time per token, per-rank weight bytes vs the ideal total/tp, identical tokens; and compile.build time per
graph for the same model (CPU backend: contract check + torch.export).

    python -m benchmarks.tp        (~3 min on 2 cores; ranks share the 2 cores, so tp > 2 cannot be faster here)
    python -m benchmarks.tp --quick   (smoke test: tp 1 and 2, 8 tokens, one run each, one bucket per graph)

Weight bytes are the engines' own (Engine.weight_bytes(), per rank m.ranks.call("weight_bytes")); ms/token is the
median of the runs (common.time_calls) of generate's decode phase.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table, median, mid_checkpoint, test_audio, time_calls, timed


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tp 1 and 2, 8 tokens, one run, one bucket per graph")
    args = ap.parse_args(argv)
    from nxdi_voxtral import Buckets, NxDVoxtralSpecDec
    from nxdi_voxtral.engine import build_engine
    from nxdi_voxtral.build import build
    tps, tokens, runs = ((1, 2), 8, 1) if args.quick else ((1, 2, 4), 48, 2)
    d = mid_checkpoint()
    buckets = Buckets(audio_chunks=(1,), kv_lengths=(512,))
    total = build_engine(d, buckets=buckets).weight_bytes()
    rows, ref = [], None
    for tp in tps:
        with NxDVoxtralSpecDec.from_pretrained(d, buckets=buckets, tp_degree=tp) as m:
            p = m.prepare(test_audio(30.0), language="en", sampling_rate=16000)
            per_rank = m.ranks.call("weight_bytes")

            def run():
                t = {}
                ids = m.generate(p.input_ids, p.input_features, max_new_tokens=tokens, timings=t)[0].tolist()
                return ids, t["decode_s"] / (len(ids) - 1)
            outs = []
            per_token = time_calls(run, runs, warmup=0, reduce=median, seconds=lambda r: r[1], outputs=outs)
            ids = outs[-1][0]
            ref = ref or ids
            rows.append([tp, 1e3 * per_token, max(per_rank) / 2**20, total / tp / 2**20,
                         max(per_rank) / (total / tp), "yes" if ids == ref else "NO"])
    print(markdown_table(["tp", "ms/token", "weights per rank MiB (max)", "total/tp MiB", "ratio", "same tokens"],
                         rows))
    out = Path(tempfile.mkdtemp()) / "art"
    build_buckets = Buckets(audio_chunks=(1,), kv_lengths=(512,)) if args.quick else \
        Buckets(audio_chunks=(1, 2), kv_lengths=(512, 1024))
    manifest, build_s = timed(build, d, out, tp=1, buckets=build_buckets, backend="export")
    print()
    print(markdown_table(["graph", "bucket", "build s (check + export)"],
                         [[g["tag"], g["bucket"], g["seconds"]] for g in manifest["graphs"]]))
    print(f"compile.build total {build_s:.1f} s")
    shutil.rmtree(out.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
