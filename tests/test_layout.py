"""The package's shape: one import root, no import circle, the checkout's command shims, and one place that knows
backend names."""
import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "nxdi_voxtral"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Every nxdi_voxtral module `path` imports, at module level or inside a function (a lazy import closes a
    circle as surely, only later). `from pkg import name` counts as pkg.name where that is a module."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return {m for m in out if m in modules and m != me}


def test_no_import_circle():
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    graph = {m: imports_of(p, set(files)) for m, p in files.items()}
    graph.pop("nxdi_voxtral", None)  # the package root re-exports the API; a submodule import reaching it is not
    for deps in graph.values():      # a circle of the code's own
        deps.discard("nxdi_voxtral")
    state, path = {}, []

    def visit(m):
        state[m] = "open"
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "open":
                raise AssertionError("import circle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d)
        path.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_plain_checkout_on_pythonpath(tmp_path):
    """A copy of the package directory alone, on PYTHONPATH: every subpackage resolves inside it (no install, no
    editable finder mapping folders from elsewhere)."""
    shutil.copytree(PKG, tmp_path / "nxdi_voxtral", ignore=shutil.ignore_patterns("__pycache__"))
    check = ("import sys, nxdi_voxtral, nxdi_voxtral.kernels.ops as ops, nxdi_voxtral.build as build, "
             "nxdi_voxtral.release as release, nxdi_voxtral.backends as backends; "
             "assert all(m.__file__.startswith(sys.argv[1]) for m in (nxdi_voxtral, ops, build, release, backends)); "
             "print(sorted(backends.BACKENDS))")
    out = subprocess.run([sys.executable, "-c", check, str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "['eager', 'export', 'inductor', 'nxd', 'torchneuron']"


def test_checkout_command_shims():
    for cmd in (["-m", "compile.build", "--help"], ["-m", "artifacts", "--help"]):
        out = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0 and "usage" in out.stdout, (cmd, out.stderr[-2000:])


def test_backend_names_are_compared_only_in_the_registry():
    """No `== "export"` / `in ("eager", ...)` on a backend name outside nxdi_voxtral/backends/ (and the CLI's
    argument parsing, which takes the names from the registry)."""
    names = "eager|export|inductor|nxd|torchneuron|cpu|compiled|neuron"
    pattern = re.compile(rf"""(==|!=|\bin\b)\s*\(?\s*["']({names})["']|["']({names})["']\s*(==|!=)""")
    offenders = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
                 for p in PKG.rglob("*.py") if "backends" not in p.parts
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if pattern.search(line) and "backend" in line.lower()]
    assert not offenders, "\n".join(offenders)
