"""Shared by the device tests: a compiled model's tokens against the CPU backend's, and a latency table."""
from conftest import noise


def tokens_and_latency(cpu, dev, label: str) -> list[tuple]:
    """Greedy / speculative tokens of `dev` == `cpu`'s on 3 s and 41 s of audio -> rows (audio s, prefill ms,
    decode ms/token)."""
    rows = []
    for seconds, seed in ((3.0, 0), (41.0, 1)):
        p = cpu.prepare(noise(seconds, seed=seed), sampling_rate=16000)
        want = cpu.generate(p.input_ids, p.input_features, max_new_tokens=32)
        timings = {}
        got = dev.generate(p.input_ids, p.input_features, max_new_tokens=32, timings=timings)
        assert got.tolist() == want.tolist(), f"{label}: device tokens differ from the CPU backend"
        rows.append((seconds, timings["prefill_s"] * 1e3, timings["decode_s"] * 1e3 / max(1, len(got[0]) - 1)))
    return rows


def print_latency(title: str, rows: list[tuple]) -> None:
    print(f"\n{title}\n| audio s | prefill ms | decode ms/token |\n|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.2f} | {r[2]:.2f} |")
