# Lint and layer contracts run by the test command: ruff's pyflakes rules and import-linter's layers (pyproject.toml).
import ast
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import tn

ROOT = pathlib.Path(tn.__file__).resolve().parent.parent
if not (ROOT / "pyproject.toml").is_file():
    pytest.skip("tn is not an editable checkout (no pyproject.toml beside the package)", allow_module_level=True)


def _need(module: str) -> None:
    """Skip without ``module`` (a lint tool of the test extra), except in CI (``CI`` set), where it must run."""
    if importlib.util.find_spec(module) is None:
        why = f"{module} is not installed (pip install -e '.[test]' installs it)"
        if os.environ.get("CI"):
            pytest.fail(f"CI: {why}; the lint and layer checks must run in CI")
        pytest.skip(why)


def test_ruff_pyflakes_rules_pass():
    _need("ruff")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"ruff check (pyproject.toml [tool.ruff]) found:\n{r.stdout}{r.stderr}"


def _stage_package(dest: pathlib.Path) -> pathlib.Path:
    """A copy of tn's Python sources laid out as they are imported: adaptive/ as tn/adaptive and _native/ as
    tn/_native (package-dir mappings, which import-linter's graph builder does not follow)."""
    only_py = shutil.ignore_patterns("__pycache__", "*.so", "*.c", "*.h", "*.pyx", "*.o", "*.j2", "build")
    shutil.copytree(ROOT / "tn", dest / "tn", ignore=only_py)
    shutil.copytree(ROOT / "adaptive", dest / "tn" / "adaptive", ignore=only_py)
    shutil.copytree(ROOT / "_native", dest / "tn" / "_native", ignore=only_py)
    return dest


def test_layer_contracts_hold(tmp_path):
    _need("importlinter")
    staged = _stage_package(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(staged)}
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, no_cache=True))")
    r = subprocess.run([sys.executable, "-c", code], cwd=staged, env=env, capture_output=True, text=True, timeout=300)
    contracts = (ROOT / "pyproject.toml").read_text().count("[[tool.importlinter.contracts]]")
    assert f"Contracts: {contracts} kept, 0 broken" in r.stdout, f"import-linter (pyproject.toml [tool.importlinter]):\n" \
                                                     f"{r.stdout[-4000:]}{r.stderr[-2000:]}"
    assert r.returncode == 0


def _area(module: str) -> str:
    """The unit a private name may be shared in: a subpackage (tn.lower, tn.device, ...) or a top-level module."""
    return ".".join(module.split(".")[:2])


def _sources():
    for base, package in ((ROOT / "tn", "tn"), (ROOT / "adaptive", "tn.adaptive"), (ROOT / "_native", "tn._native")):
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            yield path, ".".join([package, *parts]), path.name == "__init__.py"


def _is_submodule(module: str, name: str) -> bool:
    try:
        return importlib.util.find_spec(f"{module}.{name}") is not None
    except (ImportError, ValueError):
        return False


def _import_target(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a ``from ... import`` statement in ``package`` imports from."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def test_no_private_names_imported_across_packages():
    """``from tn.x import _name`` between subpackages/modules reaches into another part's internals: each part
    offers public names (e.g. ``tn.trace.user_source``, ``tn.jit.backend_compile_fn``) instead."""
    found = []
    for path, module, is_pkg in _sources():
        package = module if is_pkg else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = _import_target(node, package)
            if not target.startswith("tn") or _area(target) == _area(module):
                continue
            for alias in node.names:
                name = alias.name
                if name.startswith("_") and not name.startswith("__") and not _is_submodule(target, name):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {target} import {name}")
    assert found == [], "private names taken across packages:\n" + "\n".join(found)


def _module_aliases(tree: ast.AST, module: str, package: str) -> dict:
    """Names a source file binds to tn modules (``from .. import trace as _trace``, ``import tn.ops as ops``):
    ``{local name: module path}``."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _import_target(node, package)
            if not target.startswith("tn"):
                continue
            for alias in node.names:
                if _is_submodule(target, alias.name):
                    aliases[alias.asname or alias.name] = f"{target}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("tn.") and alias.asname:
                    aliases[alias.asname] = alias.name
    return aliases


def test_no_private_attributes_read_across_packages():
    """``trace._resolve(...)`` through a module alias is the same reach into another part's internals as
    ``from tn.trace import _resolve``: it fails here too (the tracer offers ``records_as_core_op``, ``can_replay``,
    ``is_internal_code`` ... instead)."""
    found = []
    for path, module, is_pkg in _sources():
        package = module if is_pkg else module.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text(), str(path))
        aliases = {k: v for k, v in _module_aliases(tree, module, package).items() if _area(v) != _area(module)}
        if not aliases:
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not _is_submodule(aliases[node.value.id], node.attr)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {aliases[node.value.id]}.{node.attr}")
    assert found == [], "private attributes read across packages:\n" + "\n".join(sorted(set(found)))


def _function_level_imports(tree: ast.AST):
    """``(node, line)`` of every import made inside a function: ``import``/``from`` statements and
    ``importlib.import_module(...)`` / ``__import__(...)`` calls."""
    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            elif in_function and isinstance(child, ast.Call) and (
                    (isinstance(child.func, ast.Attribute) and child.func.attr == "import_module")
                    or (isinstance(child.func, ast.Name) and child.func.id == "__import__")):
                yield child
            yield from walk(child, inner)
    yield from walk(tree, False)


def _lazy_reason(lines, node) -> bool:
    """Whether the import at ``node`` says why it is lazy: ``# lazy: <reason>`` on one of its lines or on the line
    just above it."""
    span = lines[node.lineno - 2:node.end_lineno] if node.lineno > 1 else lines[:node.end_lineno]
    for line in span:
        _, hash_, comment = line.partition("#")
        reason = comment.partition("lazy:")[2].strip() if hash_ and "lazy:" in comment else ""
        if reason:
            return True
    return False


def test_function_level_imports_say_why_they_are_lazy():
    """An import inside a function hides a dependency from the module's header and from the layer contracts'
    reader; in tn/, adaptive/ and _native/ it is allowed only for a lazy load with a reason on its line
    (``# lazy: <reason>``: a heavy optional dependency, a module ``import tn`` must not pay for). An import cycle
    is not a reason: break it with a seam (a small shared module, registration from above)."""
    found = []
    for path, _module, _is_pkg in _sources():
        text = path.read_text()
        lines = text.splitlines()
        for node in _function_level_imports(ast.parse(text, str(path))):
            if not _lazy_reason(lines, node):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert found == [], "function-level imports without a '# lazy: <reason>' comment:\n" + "\n".join(found)


def test_lazy_import_check_fails_on_an_unexplained_import():
    """The check above flags a function-level import without a reason and passes one that gives it."""
    bare = "def f():\n    import json\n    return json\n"
    said = "def f():\n    import json  # lazy: only f needs it\n    return json\n"
    above = "def f():\n    # lazy: the provider loads on first use\n    return importlib.import_module('m')\n"
    empty = "def f():\n    import json  # lazy:\n    return json\n"
    top = "import json\n\n\ndef f():\n    return json\n"

    def flagged(src):
        lines = src.splitlines()
        return [n.lineno for n in _function_level_imports(ast.parse(src)) if not _lazy_reason(lines, n)]

    assert flagged(bare) == [2]
    assert flagged(said) == []
    assert flagged(above) == []
    assert flagged(empty) == [2]
    assert flagged(top) == []
