"""python -m artifacts pack DIR -o NAME.tar | verify DIR|TAR | deploy TAR --to DEST | deploy --to DEST --rollback

deploy takes DEST/.deploy.lock (a second deploy waits, then fails with "busy"), unpacks into a temporary sibling,
verifies it (every file listed and intact, no unlisted file), moves it to DEST/releases/<id> and switches the
DEST/current link atomically (rename of a link): a host that loads DEST/current never sees a half-copied artifact.
DEST/history.json lists the last --keep releases, oldest first (DEST/previous links the one before current).
--rollback verifies the release before current and switches to it, dropping current from the history; a second
--rollback walks one further back. A rollback target that does not verify is refused, and current stays.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from nxdi_voxtral.errors import ArtifactError
from nxdi_voxtral.manifest import MANIFEST, verify

LOCK, HISTORY = ".deploy.lock", "history.json"
DEFAULT_KEEP, DEFAULT_WAIT_S = 5, 300.0


def pack(art_dir: Path, out_tar: Path) -> Path:
    manifest = verify(art_dir)
    if not out_tar.parent.is_dir():
        raise ArtifactError(f"-o {out_tar}: directory {out_tar.parent} does not exist")
    if out_tar.is_dir():
        raise ArtifactError(f"-o {out_tar}: is a directory; give a file name")
    try:
        with tarfile.open(out_tar, "w") as tar:
            tar.add(art_dir / MANIFEST, arcname=MANIFEST)  # first: a reader learns what to expect before the rest
            for entry in manifest["files"]:
                if not os.path.isabs(entry["path"]):
                    tar.add(art_dir / entry["path"], arcname=entry["path"])
    except OSError as e:
        raise ArtifactError(f"-o {out_tar}: cannot write ({e.strerror or e})") from None
    return out_tar


def unpack(tar_path: Path, dest: Path) -> None:
    # TEST HOOKS, unset outside tests: NXDI_VOXTRAL_DEPLOY_SLOW=S sleeps S s after each member (two deploys overlap:
    # tests/test_hardening_deploy.py); NXDI_VOXTRAL_DEPLOY_CRASH_AFTER=N SIGKILLs this process once N members are
    # written (a deploy that dies mid-copy at a known point: tests/test_artifacts.py)
    slow = float(os.environ.get("NXDI_VOXTRAL_DEPLOY_SLOW", "0"))
    crash_after = int(os.environ.get("NXDI_VOXTRAL_DEPLOY_CRASH_AFTER", "0"))
    try:
        with tarfile.open(tar_path) as tar:
            for n, member in enumerate(tar, 1):
                tar.extract(member, dest, filter="data")
                if n == crash_after:
                    os.kill(os.getpid(), signal.SIGKILL)  # delivered before kill returns
                time.sleep(slow)
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ArtifactError(f"{tar_path}: cannot unpack ({e})") from None


def verify_any(path: Path) -> dict:
    if not path.exists():
        raise ArtifactError(f"{path}: no such artifact directory or tar file")
    if path.is_dir():
        return verify(path)
    with tempfile.TemporaryDirectory() as tmp:
        unpack(path, Path(tmp))
        return verify(Path(tmp), exact=True)


# ---------------------------------------------------------------- the destination: lock, links, history

@contextmanager
def locked(dest: Path, wait_s: float):
    """One deploy or rollback at a time on DEST (flock: released by the kernel if the holder dies)."""
    fd = os.open(dest / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                    raise ArtifactError(f"{dest}: busy: another deploy or rollback (pid {holder}) holds {dest / LOCK};"
                                        f" waited {wait_s:g} s (--wait)") from None
                time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def prepare_dest(dest: Path) -> None:
    if dest.exists() and not dest.is_dir():
        raise ArtifactError(f"--to {dest}: exists and is not a directory")
    dest.mkdir(parents=True, exist_ok=True)


def check_links(dest: Path) -> None:
    for name in ("current", "previous"):
        p = dest / name
        if (p.exists() or p.is_symlink()) and not p.is_symlink():
            raise ArtifactError(f"{p}: is a real {'directory' if p.is_dir() else 'file'}, not a link; deploy "
                                f"manages it as a link: move it away first")


def _owner_alive(name: str) -> bool:
    m = re.match(r"\.(?:incoming|current|previous|history\.json)[-.](\d+)", name)
    if not m or int(m.group(1)) == os.getpid():
        return False
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def clean_stale(dest: Path) -> None:
    """Leftovers of deploys that died (SIGKILL): under the lock, any entry whose owner is gone."""
    for p in [*dest.glob(".incoming-*"), *dest.glob(".current.*"), *dest.glob(".previous.*"),
              *dest.glob(f".{HISTORY}.*")]:
        if not _owner_alive(p.name):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def switch_link(dest: Path, name: str, target: str | None) -> None:
    tmp = dest / f".{name}.{os.getpid()}"
    if target is None:
        (dest / name).unlink(missing_ok=True)
        return
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    try:
        os.replace(tmp, dest / name)  # atomic
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ArtifactError(f"{dest / name}: cannot switch the link ({e.strerror or e})") from None


def read_history(dest: Path) -> list[str]:
    """Release ids, oldest first, ending with current's. The current link is the truth: a history that disagrees
    (a deploy that died between writing the history and switching the link) is cut back to it."""
    link = lambda n: os.path.basename(os.readlink(dest / n)) if (dest / n).is_symlink() else None  # noqa: E731
    try:
        history = json.loads((dest / HISTORY).read_text())
        if not (isinstance(history, list) and all(isinstance(h, str) for h in history)):
            raise ValueError("not a list of release ids")
    except FileNotFoundError:
        history = [r for r in (link("previous"), link("current")) if r]  # a destination from before the history
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{dest / HISTORY}: corrupted ({e})") from None
    current = link("current")
    if current in history:
        history = history[:history.index(current) + 1]
    elif current:
        history.append(current)
    return history


def activate(dest: Path, history: list[str]) -> None:
    tmp = dest / f".{HISTORY}.{os.getpid()}"
    tmp.write_text(json.dumps(history))
    os.replace(tmp, dest / HISTORY)
    switch_link(dest, "previous", f"releases/{history[-2]}" if len(history) > 1 else None)
    switch_link(dest, "current", f"releases/{history[-1]}")


def prune(dest: Path, history: list[str], keep: int) -> list[str]:
    """Keep the newest `keep` releases of the history; delete release directories outside it."""
    history = history[-keep:]
    for d in (dest / "releases").iterdir():
        if d.name not in history:
            shutil.rmtree(d, ignore_errors=True)
    return history


def deploy(tar_path: Path, dest: Path, keep: int = DEFAULT_KEEP, wait_s: float = DEFAULT_WAIT_S) -> Path:
    if keep < 1:
        raise ArtifactError(f"--keep must be at least 1, got {keep}")
    prepare_dest(dest)
    with locked(dest, wait_s):
        check_links(dest)
        (dest / "releases").mkdir(exist_ok=True)
        clean_stale(dest)
        history = read_history(dest)
        incoming = Path(tempfile.mkdtemp(dir=dest, prefix=f".incoming-{os.getpid()}-"))
        try:
            unpack(tar_path, incoming)
            verify(incoming, exact=True)
            digest = hashlib.sha256((incoming / MANIFEST).read_bytes()).hexdigest()[:12]
            release_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{digest}"
            n = 1
            while (dest / "releases" / release_id).exists():  # the same artifact again within a second
                release_id, n = f"{time.strftime('%Y%m%d-%H%M%S')}-{digest}-{n}", n + 1
            release = dest / "releases" / release_id
            os.replace(incoming, release)
        except BaseException:
            shutil.rmtree(incoming, ignore_errors=True)  # a failed deploy leaves nothing behind
            raise
        history = prune(dest, history + [release_id], keep)
        activate(dest, history)
        return release


def rollback(dest: Path, wait_s: float = DEFAULT_WAIT_S) -> str:
    if not dest.is_dir():
        raise ArtifactError(f"--to {dest}: no such deploy directory")
    with locked(dest, wait_s):
        check_links(dest)
        history = read_history(dest)
        if len(history) < 2:
            raise ArtifactError(f"{dest}: no earlier release to roll back to (history: {history or 'empty'})")
        target = history[-2]
        try:
            verify(dest / "releases" / target)
        except ArtifactError as e:
            raise ArtifactError(f"{dest}: refusing to roll back to releases/{target}, it does not verify ({e}); "
                                f"current stays releases/{history[-1]}") from None
        activate(dest, history[:-1])
        return f"releases/{target}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m artifacts")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("dir")
    p.add_argument("-o", "--output", required=True)
    v = sub.add_parser("verify")
    v.add_argument("path")
    d = sub.add_parser("deploy")
    d.add_argument("tar", nargs="?")
    d.add_argument("--to", required=True)
    d.add_argument("--rollback", action="store_true",
                   help="switch current back to the release before it (verified first); repeat to walk further back")
    d.add_argument("--keep", type=int, default=DEFAULT_KEEP, help="releases kept in the history (default %(default)s)")
    d.add_argument("--wait", type=float, default=DEFAULT_WAIT_S,
                   help="seconds to wait for another deploy on DEST before failing with 'busy' (default %(default)s)")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "pack":
            print(pack(Path(a.dir), Path(a.output)))
        elif a.cmd == "verify":
            m = verify_any(Path(a.path))
            print(f"ok: {len(m['files'])} files, {len(m.get('graphs') or [])} graphs, backend={m.get('backend')}, "
                  f"tp={m.get('tp')}")
        elif a.rollback:
            print(f"current -> {rollback(Path(a.to), a.wait)}")
        else:
            if not a.tar:
                ap.error("deploy needs TAR (or --rollback)")
            print(f"current -> {deploy(Path(a.tar), Path(a.to), a.keep, a.wait)}")
    except ArtifactError as e:
        print(f"error: ArtifactError: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
