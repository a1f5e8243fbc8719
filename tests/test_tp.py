"""Tensor parallelism: tp in {2, 4} gives the same greedy tokens as tp = 1 (and close features), for the target
alone and for every draft kind, with kv-head replication (tp > n_kv) and a vocabulary that tp does not divide."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from nxdi_voxtral import CheckpointError, ConfigError, NxDVoxtralSpecDec
from nxdi_voxtral.config import AudioEncoderConfig, TextConfig, VoxtralConfig
from nxdi_voxtral.tp import Comm, layout, shard_tensor, vocab_greedy

from conftest import SMALL_BUCKETS, noise
from proc_helpers import kill_started

TP_CFG = VoxtralConfig(
    audio=AudioEncoderConfig(hidden_size=32, intermediate_size=128, num_layers=1, num_heads=4),
    text=TextConfig(vocab_size=2050, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                    num_kv_heads=2, head_dim=16))


@pytest.fixture(scope="module")
def tp_dirs(tmp_path_factory):
    from nxdi_voxtral.synthetic import (damp_dropped_layers, random_state_dict, write_checkpoint,
                                        write_layer_draft, write_random_dflash)
    root = tmp_path_factory.mktemp("tp")
    target = write_checkpoint(root / "target", TP_CFG, damp_dropped_layers(random_state_dict(TP_CFG, 21), [0, 2], 0.05))
    return {"target": target, "layers": write_layer_draft(target, root / "layers", [0, 2]),
            "dflash": write_random_dflash(root / "dflash", TP_CFG, target_layer_ids=(0, 2), num_layers=1, seed=3)}


def run_case(d, kind, tp, prompts, k=None):
    m = NxDVoxtralSpecDec.from_pretrained(d["target"], draft=d.get(kind), draft_kind=kind, num_speculative_tokens=k,
                                          buckets=SMALL_BUCKETS, tp_degree=tp)
    with m:
        return [m.generate(p.input_ids, p.input_features, max_new_tokens=n)[0].tolist() for p, n in prompts]


@pytest.fixture(scope="module")
def prompts(tp_dirs):
    m = NxDVoxtralSpecDec.from_pretrained(tp_dirs["target"], buckets=SMALL_BUCKETS)
    return [(m.prepare(noise(3.0, seed=1), sampling_rate=16000), 24), (m.prepare(noise(33.0, seed=2),
                                                                                sampling_rate=16000), 12)]


@pytest.mark.parametrize("kind,k", [(None, None), ("layers", 3), ("dflash", 15), ("ngram", 2)])
def test_tp_tokens_equal_single_rank(tp_dirs, prompts, kind, k):
    ref = run_case(tp_dirs, kind, 1, prompts, k)
    assert len(set(ref[0])) > 8
    for tp in (2, 4):
        assert run_case(tp_dirs, kind, tp, prompts, k) == ref, tp


def test_tp_features_close_and_layout(tp_dirs, prompts):
    """Hidden states that cross ranks (DFlash capture features of the prompt) within fp32 tolerance."""
    from nxdi_voxtral import generate as gen
    p = prompts[0][0]

    def features(tp):
        with NxDVoxtralSpecDec.from_pretrained(tp_dirs["target"], draft=tp_dirs["dflash"], draft_kind="dflash",
                                               buckets=SMALL_BUCKETS, tp_degree=tp) as m:
            nb, mel, ids, pos, last = gen.prepare_prefill(p.input_ids, p.input_features, m.cfg, m.buckets)
            (emb,) = m.run("audio_encoder", nb, mel)
            return emb, m.run("context_encoding", nb, ids, emb, pos, last, torch.zeros(1, dtype=torch.int32))[1]
    e1, f1 = features(1)
    e4, f4 = features(4)
    torch.testing.assert_close(e4, e1, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(f4, f1, rtol=1e-4, atol=1e-4)
    lay = layout(TP_CFG.text, TP_CFG.audio, 4, 3)
    assert lay.kv_replicated and lay.kv_heads == 1 and lay.vocab_local == 513 and lay.audio_sharded


def test_sharding_math_reassembles():
    torch.manual_seed(0)
    w = torch.randn(8 * 16, 64)  # 8 kv heads x head_dim 16 would split; here 2 kv heads replicated over tp 4
    lays = [layout(TP_CFG.text, TP_CFG.audio, 4, r) for r in range(4)]
    q = torch.randn(64, 64)
    assert torch.equal(torch.cat([shard_tensor("language_model.layers.0.self_attn.q_proj.weight", q, l)
                                  for l in lays]), q)
    o = torch.randn(64, 64)
    assert torch.equal(torch.cat([shard_tensor("language_model.layers.0.self_attn.o_proj.weight", o, l)
                                  for l in lays], dim=1), o)
    kv = w[:32]
    shards = [shard_tensor("language_model.layers.0.self_attn.k_proj.weight", kv, l) for l in lays]
    assert torch.equal(shards[0], kv[:16]) and torch.equal(shards[1], kv[:16]) and torch.equal(shards[3], kv[16:])
    emb = torch.randn(2050, 64)
    parts = [shard_tensor("lm_head.weight", emb, l) for l in lays]
    assert all(p.shape == (513, 64) for p in parts) and torch.equal(torch.cat(parts)[:2050], emb)
    assert torch.all(parts[-1][-2:] == 0)


class SimulatedComm(Comm):
    """all_gather over values each rank computed serially (enough to test the argmax combine)."""

    def __init__(self, per_rank):
        self.per_rank, self.size = per_rank, len(per_rank)

    def all_gather(self, x):
        return torch.stack(self.per_rank.pop(0))


def test_cross_rank_argmax_first_index_ties_and_padding():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0, 3.0, -1.0, 9.0]])  # vocab 7 + 1 padded column (9.0 must lose)
    tp, n = 4, 2
    shards = logits.chunk(tp, dim=-1)
    best, idx = [], []
    for r, s in enumerate(shards):
        s = torch.where((r * n + torch.arange(n)) < 7, s, torch.full_like(s, float("-inf")))
        i = torch.argmax(s, -1)
        best.append(s.gather(-1, i[:, None])[:, 0])
        idx.append(i + r * n)
    comm = SimulatedComm([best, idx])
    comm.rank = 0
    assert vocab_greedy(shards[0], 0, 7, comm).tolist() == [1] == torch.argmax(logits[:, :7], -1).tolist()


def test_bad_tp_degree_errors(tp_dirs, tmp_path):
    with pytest.raises(ConfigError, match="must divide the number of attention heads"):
        NxDVoxtralSpecDec.from_pretrained(tp_dirs["target"], buckets=SMALL_BUCKETS, tp_degree=3)
    with pytest.raises(ConfigError, match="tp_degree"):
        NxDVoxtralSpecDec.from_pretrained(tp_dirs["target"], buckets=SMALL_BUCKETS, tp_degree=0)
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ("config.json", "tekken.json"):
        (bad / f).write_bytes((tp_dirs["target"] / f).read_bytes())
    (bad / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot read safetensors"):  # raised inside a rank, typed as usual
        NxDVoxtralSpecDec.from_pretrained(bad, buckets=SMALL_BUCKETS, tp_degree=2)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    st = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(st) and not st.startswith("Z")


@pytest.mark.parametrize("how", ["close", "ctrl_c", "sigkill"])
def test_rank_processes_never_outlive_the_runtime(tp_dirs, how, tmp_path):
    # The child installs Python's default SIGINT handler itself: started from a shell's background job it inherits
    # SIGINT ignored, and its Ctrl-C would do nothing. It acts only when the test says so (a line on stdin), so the
    # ranks are checked alive first in every case.
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.path.insert(0, {str(tp_dirs["target"].parents[0])!r})
        from nxdi_voxtral import NxDVoxtralSpecDec, Buckets
        m = NxDVoxtralSpecDec.from_pretrained({str(tp_dirs["target"])!r}, tp_degree=2,
                                              buckets=Buckets(audio_chunks=(1,), kv_lengths=(512,)))
        print(" ".join(str(p.pid) for p in m.ranks.procs), flush=True)
        sys.stdin.readline()
        if {how!r} == "close":
            m.close()
            print("closed", flush=True)
        elif {how!r} == "ctrl_c":
            os.kill(os.getpid(), signal.SIGINT)  # KeyboardInterrupt in the main thread
        while True:  # ended by the test (close, sigkill) or by the KeyboardInterrupt (ctrl_c), never by a clock
            time.sleep(1)
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    err = tmp_path / "stderr"  # a file, not a pipe: an orphan rank holding the pipe cannot block the test
    with err.open("w") as errf:
        p = subprocess.Popen([sys.executable, "-c", script], cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=errf, text=True, env={**os.environ, "PYTHONPATH": root})
    pids = []
    try:
        line = p.stdout.readline()  # blocks until the runtime is up, however long a busy machine takes
        pids = [int(x) for x in line.split()]
        assert len(pids) == 2, err.read_text()
        assert all(alive(x) for x in pids), "rank processes not running before the test acted"
        p.stdin.write("go\n")
        p.stdin.flush()
        if how == "sigkill":
            p.kill()
        elif how == "close":
            assert p.stdout.readline().strip() == "closed", err.read_text()
            deadline = time.time() + 60
            while any(alive(x) for x in pids) and time.time() < deadline:
                time.sleep(0.2)
            assert not any(alive(x) for x in pids), "workers still alive after close() while the caller lives on"
            p.kill()
        # ctrl_c: the interpreter exits through its finalizers (the workers get 10 s to stop, then SIGKILL); a
        # bounded wait, so a hang fails instead of stalling the run
        try:
            rc = p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the runtime's process did not exit within 120 s after {how}: {err.read_text()[-2000:]}")
        if how == "ctrl_c":
            # an uncaught KeyboardInterrupt ends Python by SIGINT, after the traceback and the finalizers
            assert rc == -signal.SIGINT and "KeyboardInterrupt" in err.read_text(), (rc, err.read_text()[-2000:])
        else:
            assert rc == -signal.SIGKILL
        deadline = time.time() + 60
        while any(alive(x) for x in pids) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(alive(x) for x in pids), f"orphan rank processes after {how}"
    finally:
        kill_started(p, pids)
