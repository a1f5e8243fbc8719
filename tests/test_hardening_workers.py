"""Tensor-parallel runtime under interruption and rank failure (issue 13, items 1, 6, 7 and the worker noise):
Ctrl-C mid-call leaves a usable runtime, a dead / stopped rank is named, a closed model raises one typed error,
and the socket directory does not outlive a SIGTERMed parent (nor a SIGKILLed one, past the next start-up).

No races: every interrupt and every kill lands at a chosen point (the n-th emitted token, or the next message to
or from the ranks after it) through generate's on_tokens callback and patched message functions of
nxdi_voxtral.workers, so a fast or a loaded machine takes the same path. (The one clock is the per-call timeout
that test_stopped_rank_times_out_naming_it is about, run against a rank that is stopped for certain.)"""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from nxdi_voxtral import Buckets, NxDVoxtralSpecDec, workers
from nxdi_voxtral.errors import ModelClosedError, WorkerError
from nxdi_voxtral.workers import TMP_PREFIX, proc_state, sweep_stale_tmpdirs

from conftest import noise
from proc_helpers import kill_started

B = Buckets(audio_chunks=(1,), kv_lengths=(512,))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_NEW = 120  # 391 prompt tokens + 120 fit the 512 bucket
AT = 40      # the token after which each interrupt / kill is armed: well inside the decode loop


@pytest.fixture(scope="module")
def prompt(tiny_dir):
    return NxDVoxtralSpecDec.from_pretrained(tiny_dir, buckets=B).prepare(noise(2.0, seed=4), sampling_rate=16000)


@pytest.fixture
def sigint_raises():
    """Ctrl-C raises KeyboardInterrupt for the test's duration, whatever this process inherited (a shell's
    background job starts with SIGINT ignored: the interrupts below would then never land)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def gen(m, p, on_tokens=None):
    return m.generate(p.input_ids, p.input_features, max_new_tokens=N_NEW, on_tokens=on_tokens)[0].tolist()


def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)  # what a terminal's Ctrl-C delivers; handled before os.kill returns


class Trap:
    """Armed by generate's on_tokens once AT tokens were emitted; `spring()` is then true exactly once."""

    def __init__(self, on_armed=None):
        self.emitted, self.armed, self.sprung, self.on_armed = 0, False, False, on_armed

    def on_tokens(self, ids):
        self.emitted += len(ids)
        if not self.armed and self.emitted >= AT:
            self.armed = True
            if self.on_armed:
                self.on_armed()

    def spring(self) -> bool:
        if self.armed and not self.sprung:
            self.sprung = True
            return True
        return False


def on_next_wait(trap, action, monkeypatch):
    """Patch nxdi_voxtral.workers.wait: the first call once `trap` is armed runs `action()` before it waits (the
    request is with every rank then, no answer read yet)."""
    real_wait = workers.wait

    def wait(*a, **k):
        if trap.spring():
            action()
        return real_wait(*a, **k)
    monkeypatch.setattr(workers, "wait", wait)


def interrupt_at(where, m, monkeypatch):
    """A Trap whose Ctrl-C lands at `where` (patching nxdi_voxtral.workers' message functions as needed), and a
    list the patched functions append to after the Ctrl-C was sent."""
    after = []
    trap = Trap()
    if where == "between graph calls":  # in the host loop, right after a graph call returned
        trap.on_armed = lambda: trap.spring() and ctrl_c()
    elif where == "waiting for the answers":  # the request is with every rank, no answer read yet
        on_next_wait(trap, ctrl_c, monkeypatch)
    elif where == "sending a request":  # written to rank 0, not yet to rank 1: deferred until both have it
        real_send = workers.send

        def send(conn, obj):
            real_send(conn, obj)
            if trap.sprung:
                after.append(("sent to rank", m.ranks.conns.index(conn)))
            if conn is m.ranks.conns[0] and trap.spring():
                ctrl_c()
        monkeypatch.setattr(workers, "send", send)
    elif where == "reading an answer":  # deferred until the answer is read whole
        real_recv = workers.recv

        def recv(conn):
            fired = trap.spring()
            if fired:
                ctrl_c()
            out = real_recv(conn)
            if fired:
                after.append(("read answer", out[0]))
            return out
        monkeypatch.setattr(workers, "recv", recv)
    else:
        raise ValueError(where)
    return trap, after


def test_ctrl_c_mid_call_then_same_tokens_and_dead_rank_named(tiny_dir, prompt, sigint_raises, monkeypatch):
    p = prompt
    m = NxDVoxtralSpecDec.from_pretrained(tiny_dir, buckets=B, tp_degree=2)
    try:
        interrupts_then_dead_rank(m, p, monkeypatch)
    finally:
        m.close()


def interrupts_then_dead_rank(m, p, monkeypatch):
    ref = gen(m, p)  # tp 2 == tp 1 is test_tp's business; here: the same runtime before and after interrupts
    assert len(ref) == N_NEW > AT
    for where in ("between graph calls", "waiting for the answers", "sending a request", "reading an answer"):
        with monkeypatch.context() as mp:
            trap, after = interrupt_at(where, m, mp)
            with pytest.raises(KeyboardInterrupt):
                gen(m, p, trap.on_tokens)
        assert trap.sprung, where
        if where == "sending a request":
            assert after == [("sent to rank", 1)], after  # the interrupted request still reached rank 1
        if where == "reading an answer":
            assert len(after) == 1, after  # the message was read whole before the KeyboardInterrupt
        assert gen(m, p) == ref, f"tokens differ after a Ctrl-C {where}"
    # a rank that dies while idle: the next call names it, later calls say the model must be recreated
    m.ranks.procs[1].kill()
    m.ranks.procs[1].wait()
    with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) died \(killed by SIGKILL\) while idle"):
        gen(m, p)
    assert not m.ranks.alive  # rank 0 was shut down with it
    with pytest.raises(ModelClosedError, match="create a new model"):
        gen(m, p)
    m.close()
    with pytest.raises(ModelClosedError, match="closed"):
        gen(m, p)


def wait_for_state(pid, states, timeout=60):
    deadline = time.monotonic() + timeout
    while proc_state(pid) not in states:
        assert time.monotonic() < deadline, f"pid {pid} never reached state {states}: {proc_state(pid)!r}"
        time.sleep(0.01)


@pytest.mark.parametrize("where", ["between graph calls", "inside a graph call"])
def test_rank_killed_mid_call_is_named(tiny_dir, prompt, where, monkeypatch):
    p = prompt
    m = NxDVoxtralSpecDec.from_pretrained(tiny_dir, buckets=B, tp_degree=2)
    victim = m.ranks.procs[1]

    def kill_victim():
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=60)  # reaped: the runtime sees how it ended, whenever it looks

    if where == "between graph calls":  # after AT tokens, before the next graph call
        trap = Trap(on_armed=kill_victim)
        expected = r"rank 1 \(pid \d+\) died \(killed by SIGKILL\) while idle"
    else:
        # after AT tokens rank 1 is stopped while it waits for the next request, so it never reads it; once that
        # request is out (rank 0 runs the graph, blocked in its first collective) rank 1 is killed
        def stop_victim():
            os.kill(victim.pid, signal.SIGSTOP)
            wait_for_state(victim.pid, ("T", "t"))
        trap = Trap(on_armed=stop_victim)
        on_next_wait(trap, kill_victim, monkeypatch)
        expected = r"\w+\[\d+\]: rank 1 \(pid \d+\) died \(killed by SIGKILL\)"
    try:
        with pytest.raises(WorkerError, match=expected) as e:
            gen(m, p, trap.on_tokens)
        assert trap.armed and victim.returncode == -signal.SIGKILL
        assert "gloo" not in str(e.value), str(e.value)  # rank 1 named, not rank 0's view of the broken collective
        assert not m.ranks.alive
        with pytest.raises(ModelClosedError):
            gen(m, p)
    finally:
        if victim.poll() is None:
            victim.kill()
        m.close()


def test_stopped_rank_times_out_naming_it(tiny_dir, prompt):
    p = prompt
    m = NxDVoxtralSpecDec.from_pretrained(tiny_dir, buckets=B, tp_degree=2, call_timeout_s=2)
    stopped = m.ranks.procs[1]
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=rf"timed out after \d+ s: rank 1 \(pid {stopped.pid}\) is stopped"):
            gen(m, p)
        assert time.monotonic() - t0 < 30
        assert stopped.poll() is not None and not m.ranks.alive  # killed, not left stopped
    finally:
        if stopped.poll() is None:
            os.kill(stopped.pid, signal.SIGCONT)
        m.close()


def test_closed_single_rank_model_raises_typed_error(tiny_dir, prompt):
    p = prompt
    m = NxDVoxtralSpecDec.from_pretrained(tiny_dir, buckets=B)
    m.close()
    with pytest.raises(ModelClosedError):
        m.generate(p.input_ids, p.input_features, max_new_tokens=3)


def test_sweep_removes_only_dirs_of_dead_owners(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"{TMP_PREFIX}{dead.pid}_abc"
    live = tmp_path / f"{TMP_PREFIX}{os.getpid()}_def"
    other = tmp_path / "nxdi_voxtral_tp_unrelated"
    for d in (stale, live, other):
        d.mkdir()
        (d / "sock").write_text("")
    assert sweep_stale_tmpdirs(tmp_path) == [stale]
    assert not stale.exists() and live.exists() and other.exists()


def test_sigterm_parent_leaves_no_temp_dir_and_startup_sweeps_stale_ones(tiny_dir, tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"{TMP_PREFIX}{dead.pid}_x1"  # what a SIGKILLed parent leaves behind
    stale.mkdir()
    script = textwrap.dedent(f"""
        import time
        from nxdi_voxtral import NxDVoxtralSpecDec, Buckets
        m = NxDVoxtralSpecDec.from_pretrained({str(tiny_dir)!r}, tp_degree=2,
                                              buckets=Buckets(audio_chunks=(1,), kv_lengths=(512,)))
        print(m.ranks.tmpdir, *(p.pid for p in m.ranks.procs), flush=True)
        time.sleep(600)
    """)
    err = tmp_path / "stderr"  # a file, not a pipe: an orphan rank holding the pipe cannot block the test
    with err.open("w") as errf:
        p = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=errf,
                             text=True, env={**os.environ, "PYTHONPATH": ROOT, "TMPDIR": str(tmp_path)})
    pids = []
    try:
        line = p.stdout.readline().split()
        assert line, err.read_text()
        tmpdir, pids = line[0], [int(x) for x in line[1:]]
        assert os.path.isdir(tmpdir) and os.path.dirname(tmpdir) == str(tmp_path)
        assert not stale.exists()
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == -signal.SIGTERM
        assert not os.path.exists(tmpdir)
        deadline = time.time() + 30
        while any(proc_state(x) not in ("", "Z") for x in pids) and time.time() < deadline:
            time.sleep(0.2)
        assert all(proc_state(x) in ("", "Z") for x in pids), "rank processes outlived the SIGTERMed parent"
    finally:
        kill_started(p, pids)
    assert "found in sys.modules" not in err.read_text()  # no runpy warning from each rank
