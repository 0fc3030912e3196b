"""No function in the packages is longer than ``MAX_LINES``: a function that long does several things, and the
next engineer reads it whole to change one (issue 53). Counted with ``ast`` from ``def`` to the function's last line,
docstring and comments included."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("torch_meganeura", "lowering", "kernels", "runtime")
MAX_LINES = 60


def long_functions(source: str, limit: int = MAX_LINES) -> list[tuple[str, int, int]]:
    """(name, first line, length) of every function or method of ``source`` longer than ``limit`` lines."""
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= limit]


def test_no_function_is_over_the_limit():
    files = [f for folder in FOLDERS for f in sorted((ROOT / folder).rglob("*.py"))]
    assert len(files) > 50  # the walk found the packages
    long = [f"{f.relative_to(ROOT)}:{line} {name} ({n} lines)" for f in files
            for name, line, n in long_functions(f.read_text())]
    assert not long, f"functions over {MAX_LINES} lines: {long}"


def test_a_long_function_is_found():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    assert long_functions(f"def short():\n    return 1\n\n\ndef long():\n{body}\n") == [("long", 5, MAX_LINES + 1)]
