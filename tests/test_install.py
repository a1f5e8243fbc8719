"""An install claims no generic top-level names: `pip install .` beside PyPI's `kernels` package leaves both
importable and working (ours installs as nxdi_voxtral.kernels / .compile / .artifacts, with console scripts).

`kernels` comes from the package index pip is configured with: where that index cannot be reached the test is
skipped, saying so (a bounded check first; a hung or offline index never stalls the run)."""
import hashlib
import os
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE_TIMEOUT_S = 5


def pip(*args, cwd):
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *args], cwd=cwd, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def configured_index_url() -> str | None:
    """The index pip would use, as configured (PIP_INDEX_URL, or index-url in `pip config list`); None: pip's
    built-in default, which this test does not name."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"]
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             timeout=60).stdout
    except subprocess.TimeoutExpired:
        return None
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.split(".")[-1] == "index-url":
            return value.strip().strip("'\"") or None
    return None


def index_unreachable(url: str) -> str | None:
    """Why the index host cannot be reached (a TCP connect bounded by PROBE_TIMEOUT_S), or None."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None  # file:// or a path: nothing to connect to, the download tells
    if any(os.environ.get(v) for v in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY", "all_proxy",
                                       "ALL_PROXY")):
        return None  # through a proxy: a direct connect says nothing, the download tells
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as e:
        return f"{parts.hostname}:{port}: {type(e).__name__}: {e}"
    return None


# what pip prints when it could not talk to an index (connection, DNS, TLS, timeout), as opposed to an index that
# answered without a usable `kernels`. pip reports a connection failure only on a retry ("Retrying ... after
# connection broken by ..."), hence --retries 1 below.
UNREACHABLE_MARKERS = ("after connection broken by", "Could not fetch URL", "NewConnectionError", "ConnectTimeout",
                       "Max retries exceeded", "NameResolutionError", "ProxyError", "SSLError", "timed out")


def download_kernels(dest: Path) -> Path:
    """PyPI's `kernels` wheel (or sdist) into dest; skip when the configured index cannot be reached."""
    url = configured_index_url()
    if url is not None:
        why = index_unreachable(url)
        if why:
            pytest.skip(f"package index {url} unreachable ({why}): cannot fetch PyPI's `kernels`")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--retries", "1", "--timeout",
           str(PROBE_TIMEOUT_S * 3), "-d", str(dest), "kernels"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        rc, out = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired:
        rc, out = None, "pip download timed out after 300 s"
    if rc != 0:
        where = url or "pip's default index"
        if rc is None or any(m in out for m in UNREACHABLE_MARKERS):
            reason = next((line.strip() for line in out.splitlines() if any(m in line for m in UNREACHABLE_MARKERS)),
                          out.strip().splitlines()[-1] if out.strip() else "")
            pytest.skip(f"package index unreachable ({where}): `pip download kernels` failed: {reason[:300]}")
        pytest.fail(f"`pip download kernels` from {where} failed although the index answered:\n{out[-2000:]}")
    (got,) = [p for p in dest.iterdir() if p.name.lower().startswith("kernels")]
    return got


def test_install_beside_pypi_kernels(tmp_path):
    site = tmp_path / "site"
    wheel = download_kernels(tmp_path / "download")
    pip("--target", str(site), str(wheel), cwd=tmp_path)  # PyPI's `kernels` (Hugging Face), installed first
    theirs = hashlib.sha256((site / "kernels" / "__init__.py").read_bytes()).hexdigest()
    pip("--target", str(site), str(ROOT), cwd=tmp_path)
    assert hashlib.sha256((site / "kernels" / "__init__.py").read_bytes()).hexdigest() == theirs
    assert not (site / "compile").exists() and not (site / "artifacts").exists()
    assert (site / "nxdi_voxtral" / "kernels" / "ops.py").is_file()
    check = ("import sys; sys.path.insert(0, sys.argv[1]); import kernels, nxdi_voxtral.kernels.ops as ops, "
             "nxdi_voxtral.build as build, nxdi_voxtral.model; "
             "assert kernels.__file__.startswith(sys.argv[1]) and hasattr(kernels, 'get_kernel'), kernels.__file__; "
             "assert ops.__file__.startswith(sys.argv[1]) and build.__file__.startswith(sys.argv[1]); "
             "print(ops.kernel_impl())")
    out = subprocess.run([sys.executable, "-c", check, str(site)], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "torch", out.stderr[-2000:]
    help_ = subprocess.run([sys.executable, "-m", "nxdi_voxtral.build", "--help"], cwd=tmp_path,
                           capture_output=True, text=True, env={"PYTHONPATH": str(site)})
    assert help_.returncode == 0 and "--tp" in help_.stdout, help_.stderr[-2000:]
