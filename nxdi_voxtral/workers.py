"""Tensor-parallel ranks on CPU: one process per rank (gloo collectives), owned by the runtime.

The host loop stays in the caller's process and calls `run(tag, bucket, *inputs)` exactly as with one rank;
every rank runs the same graph on its shard and rank 0 returns the outputs. Workers ignore Ctrl-C (the parent
shuts them down), exit when the parent's pipe closes, and are terminated if they do not answer a shutdown.
"""
from __future__ import annotations

import logging
import os
import pickle
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
import weakref
from multiprocessing.connection import Client, Listener, wait
from pathlib import Path

import torch

from .errors import VoxtralError

log = logging.getLogger(__name__)


AUTHKEY_ENV = "NXDI_VOXTRAL_WORKER_KEY"


class WorkerError(VoxtralError, RuntimeError):
    """A rank process failed; the message carries its traceback."""


def send(conn, obj) -> None:
    # plain pickle: multiprocessing's pickler would hand torch tensors over as shared-memory file descriptors
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn):
    return pickle.loads(conn.recv_bytes())


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
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=tp)
        engine = build_engine(**build_kwargs, tp=tp, rank=rank, comm=DistComm(rank, tp))
        send(conn, ("ready", engine.setup if rank == 0 else None))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        send(conn, ("error", e if isinstance(e, VoxtralError) else WorkerError(traceback.format_exc())))
        return
    while True:
        try:
            msg = recv(conn)
        except (EOFError, OSError):
            break
        if msg is None:
            break
        try:
            if msg[0] == "call":  # an Engine method on every rank (export, load_programs): all ranks answer
                send(conn, ("ok", getattr(engine, msg[1])(*msg[2], rank=rank)))
                continue
            _, tag, bucket, inputs = msg
            out = engine.run(tag, bucket, *inputs)
            if rank == 0:
                send(conn, ("ok", out))
        except BaseException as e:  # noqa: BLE001
            send(conn, ("error", e if isinstance(e, VoxtralError) else
                        WorkerError(f"rank {rank}: {traceback.format_exc()}")))
    dist.destroy_process_group()


def _shutdown(procs, conns, tmpdir) -> None:
    for c in conns:
        try:
            send(c, None)
        except (OSError, BrokenPipeError):
            pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)
    for c in conns:
        c.close()
    shutil.rmtree(tmpdir, ignore_errors=True)


class RankWorkers:
    """Rank processes started with `python -m nxdi_voxtral.workers` (not multiprocessing's spawn, which would
    re-import the caller's main script), connected over an authenticated unix socket."""

    def __init__(self, tp: int, build_kwargs: dict):
        tmpdir = tempfile.mkdtemp(prefix="nxdi_voxtral_tp_")
        authkey = secrets.token_bytes(16)
        listener = Listener(os.path.join(tmpdir, "sock"), family="AF_UNIX", authkey=authkey)
        root = str(Path(__file__).resolve().parents[1])  # the workers import this very package
        env = {**os.environ, AUTHKEY_ENV: authkey.hex(),
               "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.procs = [subprocess.Popen([sys.executable, "-m", "nxdi_voxtral.workers", listener.address, str(rank),
                                        str(tp), os.path.join(tmpdir, "gloo")], env=env) for rank in range(tp)]
        self.conns = [None] * tp
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, [], tmpdir)
        try:
            sock = listener._listener._socket  # accept() has no timeout: poll, so a dead rank is noticed
            for _ in range(tp):
                while not select.select([sock], [], [], 0.5)[0]:
                    if any(p.poll() is not None for p in self.procs):
                        self.close()
                        raise WorkerError("a tensor-parallel rank process exited during start-up")
                conn = listener.accept()
                self.conns[recv(conn)] = conn
        finally:
            listener.close()
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.conns, tmpdir)
        for c in self.conns:
            send(c, build_kwargs)
        # whichever rank answers first: a failing rank must not leave us waiting on one blocked in a collective
        pending, replies = list(self.conns), {}
        while pending:
            for conn in wait(pending):
                replies[self.conns.index(conn)] = self._recv(conn)
                pending.remove(conn)
        self.setup = replies[0]

    def _recv(self, conn):
        try:
            kind, payload = recv(conn)
        except (EOFError, OSError):
            self.close()
            raise WorkerError("a tensor-parallel rank process died") from None
        if kind == "error":
            self.close()
            raise payload
        return payload

    def run(self, tag: str, bucket: int, *inputs):
        for c in self.conns:
            send(c, ("run", tag, bucket, inputs))
        return self._recv(self.conns[0])

    def call(self, method: str, *args) -> list:
        """Engine.method(*args, rank=r) on every rank -> the per-rank results."""
        for c in self.conns:
            send(c, ("call", method, args))
        return [self._recv(c) for c in self.conns]

    def close(self) -> None:
        self._finalizer()

    @property
    def alive(self) -> bool:
        return any(p.poll() is None for p in self.procs)


if __name__ == "__main__":
    from nxdi_voxtral.workers import _worker as main  # the package's classes, not __main__'s, cross the pipe
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
