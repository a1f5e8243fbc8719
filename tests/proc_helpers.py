"""Clean-up of a child Python process that started tensor-parallel rank workers (tests/test_tp.py,
tests/test_hardening_workers.py)."""
from __future__ import annotations

import os
import signal
import subprocess


def kill_started(p: subprocess.Popen, rank_pids) -> None:
    """Whatever happened: SIGKILL the child and those of its reported rank pids that are still rank workers (the
    command line is checked, so a reused pid is spared), with bounded waits; close the child's pipes."""
    if p.poll() is None:
        p.kill()
    for pid in rank_pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"nxdi_voxtral.workers" not in f.read():
                    continue
            os.kill(pid, signal.SIGKILL)
        except OSError:  # gone already (ProcessLookupError, no /proc entry)
            continue
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    for f in (p.stdin, p.stdout):
        if f:
            f.close()
