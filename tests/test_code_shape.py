"""The code's shape, as the developers' guide states it (issue 26): kernels depend on jax alone, models know
nothing of the builders or the loop, and no library function runs past 60 lines of code (its signature and
docstring not counted).  Each check names the offenders, so a new long function or an upward import fails here
with the place to fix."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = sorted([*ROOT.joinpath("dtree_jax").rglob("*.py"), *ROOT.joinpath("pallas_kernels").rglob("*.py")])
MAX_CODE_LINES = 60
# what a layer may not import: models know masks and positions, not trees' builders or the loop
FORBIDDEN = {
    "pallas_kernels": ("dtree_jax",),
    "dtree_jax/models": ("dtree_jax.builders", "dtree_jax.loop", "dtree_jax.verify", "dtree_jax.api",
                         "dtree_jax.running", "dtree_jax.planning", "dtree_jax.loading", "dtree_jax.cli"),
    "dtree_jax/builders": ("dtree_jax.loop", "dtree_jax.api", "dtree_jax.running", "dtree_jax.cli"),
}


def code_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the end of the function."""
    body = fn.body
    has_doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
        isinstance(body[0].value.value, str)
    first = body[1] if has_doc and len(body) > 1 else body[0]
    return fn.end_lineno - first.lineno + 1


def long_functions(paths, root: pathlib.Path = ROOT) -> list[str]:
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and code_lines(node) > MAX_CODE_LINES:
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({code_lines(node)} lines)")
    return found


def imported_modules(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_no_library_function_over_60_lines_of_code():
    assert not long_functions(LIBRARY)


def test_the_length_check_can_fail(tmp_path):
    long = tmp_path / "long.py"
    long.write_text('def f():\n    """doc"""\n' + "    x = 1\n" * (MAX_CODE_LINES + 1))
    assert long_functions([long], tmp_path) == [f"long.py:1 f ({MAX_CODE_LINES + 1} lines)"]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_imports_run_one_way(layer):
    upward = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in ROOT.joinpath(layer).rglob("*.py")
        for name in imported_modules(path)
        if name.startswith(FORBIDDEN[layer])
    }
    assert not upward
    assert "dtree_jax.loop" in imported_modules(ROOT / "dtree_jax" / "running.py")  # the check sees imports
