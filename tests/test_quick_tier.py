"""The quick tier (``pytest -m quick``, :mod:`quick_tier`): its files exist, it reaches every
module of the package, and README says how to run it."""

import ast
import json
import pathlib
import subprocess
import sys

from quick_tier import QUICK_FILES

REPO = pathlib.Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
PACKAGE = REPO / "flaxformer_lite"
_SLOW_MODULE = "\npytestmark = pytest.mark.slow"


def _modules() -> set[str]:
    """Every module of the package, but the ``__main__`` of ``python -m``, which runs a
    command the quick tier calls by its function."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] != "__main__":
            names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_the_quick_files_exist_and_are_not_all_slow():
    missing = sorted(name for name in QUICK_FILES if not (TESTS / name).is_file())
    assert not missing, f"tests/quick_tier.py names files that are gone: {missing}"
    slow = [name for name in QUICK_FILES if _SLOW_MODULE in (TESTS / name).read_text()]
    assert not slow, f"files of the quick tier whose every test is slow: {slow}"


def test_the_quick_tier_imports_every_module():
    """Importing conftest.py and the quick tier's files, as pytest does, imports every module of
    the package."""
    files = ["conftest.py", *sorted(QUICK_FILES)]
    imports = "; ".join(f"import {pathlib.Path(name).stem}" for name in files)
    code = (
        f"import sys, json; sys.path.insert(0, {str(TESTS)!r}); {imports}; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('flaxformer_lite'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-2000:]
    imported = set(json.loads(done.stdout.splitlines()[-1]))
    assert not _modules() - imported, f"not reached by the quick tier: {_modules() - imported}"


def test_every_package_has_a_quick_file_of_its_own():
    """Each package of ``flaxformer_lite`` (``ops``, ``nn``, ``train``, ...) is imported by name
    by a quick file, not only reached through another package's imports."""
    named = set()
    for name in QUICK_FILES:
        for node in ast.walk(ast.parse((TESTS / name).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                named |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
            elif isinstance(node, ast.Import):
                named |= {alias.name for alias in node.names}
    parts = {".".join(module.split(".")[:2]) for module in _modules() if module.count(".") > 1}
    unnamed = sorted(part for part in parts if not any(n.startswith(part) for n in named))
    assert not unnamed, f"no quick file imports from {unnamed}"


def test_the_readme_says_how_to_run_the_quick_tier():
    readme = (REPO / "README.md").read_text()
    assert "\n.venv/bin/python -m pytest -n 2 -m quick\n" in readme
