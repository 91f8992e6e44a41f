"""No function in `octavo/` runs over 80 lines (the C++ kernels aside): a long one is split where
its parts have names (see ../shared/STYLE.md, "one owner per concept")."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "octavo"
MAX_LINES = 80


def long_functions(source: str, name: str) -> list[str]:
    return [f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > MAX_LINES]


def test_no_function_in_octavo_is_over_80_lines():
    found = [f for path in sorted(ROOT.rglob("*.py")) for f in long_functions(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "split these:\n" + "\n".join(found)


def test_the_check_sees_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    assert long_functions(f"def f():\n{body}\n", "m.py") == ["m.py:1 f (82 lines)"]
