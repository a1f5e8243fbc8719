"""An install claims no generic top-level names: `pip install .` beside PyPI's `kernels` package leaves both
importable and working (ours installs as nxdi_voxtral.kernels / .compile / .artifacts, with console scripts)."""
import hashlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pip(*args, cwd):
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *args], cwd=cwd, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_install_beside_pypi_kernels(tmp_path):
    site = tmp_path / "site"
    pip("--target", str(site), "kernels", cwd=tmp_path)  # PyPI's `kernels` (Hugging Face), installed first
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
