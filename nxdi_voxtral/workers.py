"""Tensor-parallel ranks on CPU: one process per rank (gloo collectives), owned by the runtime.

The host loop stays in the caller's process and calls `run(tag, bucket, *inputs)` exactly as with one rank;
every rank runs the same graph on its shard and rank 0 returns the outputs.

Every request carries an id and every rank answers it, so a call interrupted by Ctrl-C leaves nothing behind: the
next call drops the answers to the interrupted one. A request is written to all ranks with Ctrl-C deferred (a
request that reached only some ranks would leave the others blocked in a collective). A rank that dies, fails, or
stays silent past the per-call timeout closes the runtime with a WorkerError naming it; later calls raise
ModelClosedError. Workers ignore Ctrl-C, exit when the parent's pipe closes, die with the parent (SIGTERM via
PR_SET_PDEATHSIG) and are killed if they do not answer a shutdown. The socket directory is removed on close, at
exit and on SIGTERM; ones left by a SIGKILLed parent are swept at the next start-up.
"""
from __future__ import annotations

import logging
import os
import pickle
import re
import secrets
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from contextlib import contextmanager
from multiprocessing.connection import Client, Listener, wait
from pathlib import Path

import torch

from .errors import ModelClosedError, VoxtralError, WorkerError  # noqa: F401  (WorkerError: importable from here)

log = logging.getLogger(__name__)

AUTHKEY_ENV = "NXDI_VOXTRAL_WORKER_KEY"
TIMEOUT_ENV = "NXDI_VOXTRAL_CALL_TIMEOUT_S"
TMP_PREFIX = "nxdi_voxtral_tp_pid"
DEFAULT_CALL_TIMEOUT_S = 600.0  # one graph call; generous: a 10-chunk audio encoder on a loaded CPU is slow


def default_call_timeout() -> float | None:
    value = os.environ.get(TIMEOUT_ENV)
    if value is None:
        return DEFAULT_CALL_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        raise WorkerError(f"{TIMEOUT_ENV}={value!r}: expected a number of seconds (0: no limit)") from None
    return seconds if seconds > 0 else None


def send(conn, obj) -> None:
    # plain pickle: multiprocessing's pickler would hand torch tensors over as shared-memory file descriptors
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn):
    return pickle.loads(conn.recv_bytes())


@contextmanager
def deferred_sigint():
    """Ctrl-C inside the block is raised at its end: a message is written or read whole, never half."""
    got = []
    old = None
    if threading.current_thread() is threading.main_thread():
        current = signal.getsignal(signal.SIGINT)
        if callable(current):
            old = signal.signal(signal.SIGINT, lambda signum, frame: got.append((signum, frame)))
    try:
        yield
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)
            if got:
                old(*got[0])


def set_send_timeout(conn, seconds: float | None) -> None:
    """A write to a rank that stopped reading (SIGSTOP, hung) fails after `seconds` instead of blocking forever
    once the socket buffer is full (a mel input is MBs). The option lives on the socket, shared by the dup."""
    sec = int(seconds or 0)
    usec = int(((seconds or 0) - sec) * 1e6)
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", sec, usec))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_tmpdirs(root: str | Path | None = None) -> list[Path]:
    """Remove this user's socket directories whose owner process is gone (a parent killed with SIGKILL)."""
    removed = []
    for d in Path(root or tempfile.gettempdir()).glob(TMP_PREFIX + "*"):
        m = re.fullmatch(re.escape(TMP_PREFIX) + r"(\d+)_\w+", d.name)
        try:
            mine = d.is_dir() and not d.is_symlink() and d.stat().st_uid == os.getuid()
        except OSError:
            continue
        if m and mine and not pid_alive(int(m.group(1))):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def proc_state(pid: int) -> str:
    """Linux process state letter (R, S, D, T stopped, t traced, Z zombie), '' if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2]
    except (OSError, ValueError, IndexError):
        return ""


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _die_with_parent() -> None:
    """Linux: get SIGTERM when the parent process dies, even while blocked in a collective."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker(address: str, rank: int, tp: int, init_file: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    conn = Client(address, authkey=bytes.fromhex(os.environ.pop(AUTHKEY_ENV)))
    send(conn, rank)
    build_kwargs = recv(conn)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    import torch.distributed as dist
    from .engine import build_engine
    from .tp import DistComm
    try:
        # "gloo" on CPU; a backend on Neuron devices asks for its own (ranks.open_ranks' process_group)
        group = build_kwargs.pop("process_group", "gloo")
        dist.init_process_group(group, init_method=f"file://{init_file}", rank=rank, world_size=tp)
        engine = build_engine(**build_kwargs, tp=tp, rank=rank, comm=DistComm(rank, tp))
        send(conn, (0, "ok", engine.setup if rank == 0 else None))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        send(conn, (0, "error", e if isinstance(e, VoxtralError) else WorkerError(traceback.format_exc())))
        return
    while True:
        try:
            msg = recv(conn)
        except (EOFError, OSError):
            break
        if msg is None:
            break
        req, kind, *rest = msg
        try:
            if kind == "call":  # an Engine method on every rank (export, load_programs, compile)
                name, args = rest
                reply = (req, "ok", getattr(engine, name)(*args))
            else:
                tag, bucket, inputs = rest
                out = engine.run(tag, bucket, *inputs)
                reply = (req, "ok", out if rank == 0 else None)  # every rank answers: the parent sees who is done
        except BaseException as e:  # noqa: BLE001
            reply = (req, "error", e if isinstance(e, VoxtralError) else
                     WorkerError(f"rank {rank}: {traceback.format_exc()}"))
        send(conn, reply)
    dist.destroy_process_group()


# ------------------------------------------------------------------ parent side

_LIVE: dict[str, list] = {}  # socket dir -> rank processes of every open runtime (for the SIGTERM handler)
_sigterm_installed = False


def _on_sigterm(signum, frame) -> None:
    for tmpdir, procs in list(_LIVE.items()):
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(tmpdir, ignore_errors=True)
    _LIVE.clear()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)  # die of SIGTERM as before, now without leftovers


def _install_sigterm_cleanup() -> None:
    """Only where SIGTERM would kill the process outright (no handler of the caller's to respect)."""
    global _sigterm_installed
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
        _sigterm_installed = True


def _shutdown(procs, conns, tmpdir, grace_s: float = 10.0) -> None:
    for c in conns:
        try:
            send(c, None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)
    for c in conns:
        c.close()
    shutil.rmtree(tmpdir, ignore_errors=True)
    _LIVE.pop(tmpdir, None)


class RankWorkers:
    """Rank processes started with `python -c` importing this module (not multiprocessing's spawn, which would
    re-import the caller's main script), connected over an authenticated unix socket."""

    def __init__(self, tp: int, build_kwargs: dict, call_timeout_s: float | None = None):
        self.tp = tp
        self.call_timeout_s = default_call_timeout() if call_timeout_s is None else call_timeout_s or None
        self.closed_reason: str | None = None
        self._req = 0
        sweep_stale_tmpdirs()
        self.tmpdir = tmpdir = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}_")
        authkey = secrets.token_bytes(16)
        listener = Listener(os.path.join(tmpdir, "sock"), family="AF_UNIX", authkey=authkey)
        root = str(Path(__file__).resolve().parents[1])  # the workers import this very package
        env = {**os.environ, AUTHKEY_ENV: authkey.hex(),
               "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        # -c, not -m nxdi_voxtral.workers: runpy warns when the package has already imported the module
        code = "import sys; from nxdi_voxtral.workers import _worker; _worker(sys.argv[1], *map(int, sys.argv[2:4]), " \
               "sys.argv[4])"
        self.procs = [subprocess.Popen([sys.executable, "-c", code, listener.address, str(rank), str(tp),
                                        os.path.join(tmpdir, "gloo")], env=env) for rank in range(tp)]
        _LIVE[tmpdir] = self.procs
        _install_sigterm_cleanup()
        self.conns = [None] * tp
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, [], tmpdir)
        try:
            sock = listener._listener._socket  # accept() has no timeout: poll, so a dead rank is noticed
            for _ in range(tp):
                while not select.select([sock], [], [], 0.5)[0]:
                    if self._dead_ranks():
                        self._fail(WorkerError(f"{self._dead_ranks()[0]} during start-up"))
                conn = listener.accept()
                set_send_timeout(conn, self.call_timeout_s)
                self.conns[recv(conn)] = conn
        finally:
            listener.close()
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.conns, tmpdir)
        self._send_all(build_kwargs, "start-up")
        self.setup = self._collect(0, None, "start-up")[0]  # loading weights: no time limit, deaths still seen

    # ---------------------------------------------------------------- health

    def _dead_ranks(self, ranks=None, crashed_only: bool = False) -> list[str]:
        """crashed_only: killed or non-zero status (a rank that reported an error at start-up exits with 0)."""
        ranks = range(self.tp) if ranks is None else ranks
        gone = [r for r in ranks if self.procs[r].poll() is not None]
        return [f"rank {r} (pid {self.procs[r].pid}) died ({describe_exit(self.procs[r].returncode)})"
                for r in gone if not (crashed_only and self.procs[r].returncode == 0)]

    def _fail(self, err: BaseException, kill: bool = True):
        """Close for good (ranks may be stuck in a collective: kill them) and raise err."""
        self.closed_reason = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
        self._finalizer.detach()
        _shutdown(self.procs, [c for c in self.conns if c is not None], self.tmpdir, grace_s=0.0 if kill else 10.0)
        raise err

    def _check_usable(self) -> None:
        if self.closed_reason is not None:
            raise ModelClosedError(f"the tensor-parallel runtime is closed ({self.closed_reason}); "
                                   "create a new model (from_pretrained / from_artifacts)")
        dead = self._dead_ranks()
        if dead:
            self._fail(WorkerError(f"{'; '.join(dead)} while idle; the runtime is closed, create a new model"))

    def _silent(self, ranks: list[int], what: str, waited: float) -> WorkerError:
        stopped = [r for r in ranks if proc_state(self.procs[r].pid) in ("T", "t")]
        if stopped:
            names = ", ".join(f"rank {r} (pid {self.procs[r].pid})" for r in stopped)
            detail = f"{names} is stopped (SIGSTOP or a debugger) and did not answer"
        else:
            detail = "no answer from " + ", ".join(f"rank {r} (pid {self.procs[r].pid})" for r in ranks)
        return WorkerError(f"{what}: timed out after {waited:.0f} s: {detail}; the runtime is closed, create a "
                           f"new model (per-call limit: call_timeout_s or {TIMEOUT_ENV})")

    # ---------------------------------------------------------------- messages

    def _send_all(self, msg, what: str) -> None:
        with deferred_sigint():  # all ranks get the request, or (a rank is gone) the runtime closes
            for r, c in enumerate(self.conns):
                t0 = time.monotonic()
                try:
                    send(c, msg)
                except BlockingIOError:  # the send timeout: the rank stopped reading
                    self._fail(self._silent([r], f"{what}: sending the request", time.monotonic() - t0))
                except OSError:
                    dead = self._dead_ranks()
                    self._fail(WorkerError(f"{what}: " + ("; ".join(dead) if dead else f"rank {r}: connection lost")))

    def _collect(self, req: int, timeout: float | None, what: str) -> list:
        """Every rank's answer to request `req`; answers to earlier (interrupted) requests are dropped."""
        t0 = time.monotonic()
        pending = {c: r for r, c in enumerate(self.conns)}
        replies, error = {}, None
        while pending:
            ready = wait(list(pending), timeout=0.2)
            for c in ready:
                r = pending[c]
                try:
                    with deferred_sigint():
                        got_req, kind, payload = recv(c)
                except (EOFError, OSError):
                    time.sleep(0.2)  # let the process be reaped, then name how it ended
                    dead = self._dead_ranks()
                    self._fail(WorkerError(f"{what}: " + ("; ".join(dead) if dead else f"rank {r}: pipe closed")))
                if got_req != req:
                    if kind == "error":  # an interrupted call failed: collectives may be broken
                        self._fail(WorkerError(f"an interrupted earlier call failed on rank {r}: {payload}"))
                    continue
                del pending[c]
                if kind == "error" and error is None:
                    error = payload
                replies[r] = payload
            if error is not None:
                # the first error may only be a peer's view of a rank that died (a gloo connection reset): name
                # a rank that died without answering (one that answered and then exited is not the cause)
                deadline = time.monotonic() + 2.0
                while pending and time.monotonic() < deadline and not self._dead_ranks(pending.values(), True):
                    time.sleep(0.05)
                dead = self._dead_ranks(pending.values(), True)
                if dead:
                    err = WorkerError(f"{what}: {'; '.join(dead)}")
                    err.__cause__ = error
                    self._fail(err)
                self._fail(error)
            if not ready:
                dead = self._dead_ranks()
                if dead:
                    self._fail(WorkerError(f"{what}: {'; '.join(dead)}"))
                waited = time.monotonic() - t0
                if timeout is not None and waited > timeout:
                    self._fail(self._silent(sorted(pending.values()), what, waited))
        return [replies[r] for r in range(self.tp)]

    def _next_request(self) -> int:
        self._req += 1
        return self._req

    def run(self, tag: str, bucket: int, *inputs):
        self._check_usable()
        req = self._next_request()
        self._send_all((req, "run", tag, bucket, inputs), f"{tag}[{bucket}]")
        return self._collect(req, self.call_timeout_s, f"{tag}[{bucket}]")[0]

    def call(self, method: str, *args) -> list:
        """Engine.method(*args) on every rank -> the per-rank results (no time limit: exports are long)."""
        self._check_usable()
        req = self._next_request()
        self._send_all((req, "call", method, args), method)
        return self._collect(req, None, method)

    def close(self) -> None:
        if self.closed_reason is None:
            self.closed_reason = "close() was called"
        self._finalizer()

    @property
    def alive(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def dead(self) -> bool:
        """A rank process has exited (the runtime is unusable; the server reopens the model)."""
        return bool(self._dead_ranks())


if __name__ == "__main__":
    from nxdi_voxtral.workers import _worker as main  # the package's classes, not __main__'s, cross the pipe
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
