"""python -m artifacts pack DIR -o NAME.tar | verify DIR|TAR | deploy TAR --to DEST [--rollback]

deploy unpacks into a temporary sibling, verifies it, moves it to DEST/releases/<id> and then switches the
DEST/current link atomically (rename of a link), keeping DEST/previous for --rollback: a host that loads
DEST/current never sees a half-copied artifact.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from nxdi_voxtral.errors import ArtifactError
from nxdi_voxtral.manifest import MANIFEST, verify


def pack(art_dir: Path, out_tar: Path) -> Path:
    manifest = verify(art_dir)
    with tarfile.open(out_tar, "w") as tar:
        tar.add(art_dir / MANIFEST, arcname=MANIFEST)  # first: a reader learns what to expect before the rest
        for entry in manifest["files"]:
            if not os.path.isabs(entry["path"]):
                tar.add(art_dir / entry["path"], arcname=entry["path"])
    return out_tar


def unpack(tar_path: Path, dest: Path) -> None:
    slow = float(os.environ.get("NXDI_VOXTRAL_DEPLOY_SLOW", "0"))  # test hook: widen the window for a crash test
    try:
        with tarfile.open(tar_path) as tar:
            for member in tar:
                tar.extract(member, dest, filter="data")
                time.sleep(slow)
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ArtifactError(f"{tar_path}: cannot unpack ({e})") from None


def verify_any(path: Path) -> dict:
    if path.is_dir():
        return verify(path)
    with tempfile.TemporaryDirectory() as tmp:
        unpack(path, Path(tmp))
        return verify(Path(tmp))


def switch_link(dest: Path, name: str, target: str) -> None:
    tmp = dest / f".{name}.{os.getpid()}"
    if tmp.is_symlink():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, dest / name)  # atomic


def deploy(tar_path: Path, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "releases").mkdir(exist_ok=True)
    for stale in dest.glob(".incoming-*"):  # left by an interrupted deploy
        shutil.rmtree(stale, ignore_errors=True)
    incoming = Path(tempfile.mkdtemp(dir=dest, prefix=".incoming-"))
    unpack(tar_path, incoming)
    verify(incoming)
    digest = hashlib.sha256((incoming / MANIFEST).read_bytes()).hexdigest()[:12]
    release_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{digest}"
    release = dest / "releases" / release_id
    os.replace(incoming, release)
    current = dest / "current"
    if current.is_symlink():
        switch_link(dest, "previous", os.readlink(current))
    switch_link(dest, "current", f"releases/{release_id}")
    return release


def rollback(dest: Path) -> str:
    cur, prev = dest / "current", dest / "previous"
    if not prev.is_symlink():
        raise ArtifactError(f"{dest}: no previous release to roll back to")
    old_cur, old_prev = os.readlink(cur), os.readlink(prev)
    switch_link(dest, "current", old_prev)
    switch_link(dest, "previous", old_cur)
    return old_prev


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
    d.add_argument("--rollback", action="store_true")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "pack":
            print(pack(Path(a.dir), Path(a.output)))
        elif a.cmd == "verify":
            m = verify_any(Path(a.path))
            print(f"ok: {len(m['files'])} files, {len(m['graphs'])} graphs, backend={m['backend']}, tp={m['tp']}")
        elif a.rollback:
            print(f"current -> {rollback(Path(a.to))}")
        else:
            if not a.tar:
                ap.error("deploy needs TAR (or --rollback)")
            print(f"current -> {deploy(Path(a.tar), Path(a.to))}")
    except ArtifactError as e:
        print(f"error: ArtifactError: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
