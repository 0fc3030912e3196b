"""What the prose cites exists. Every dotted name ``meganeura.*`` or ``torch_meganeura.*`` in a docstring or a comment
of the tree's Python files resolves to a module or to an attribute of one (a renamed or deleted module leaves no
stale citation behind), and each package's ``__init__`` docstring, its index, names every module of the package."""
from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("torch_meganeura", "lowering", "kernels", "runtime", "bench", "tests", "scripts")
TORCH_SUBPACKAGES = ("lower", "lower/aten", "tensors", "backend", "training", "bundles", "coverage")
PACKAGES = {"torch_meganeura": "torch_meganeura",
            **{f"torch_meganeura/{sub}": "torch_meganeura." + sub.replace("/", ".") for sub in TORCH_SUBPACKAGES},
            "lowering": "meganeura.lowering", "kernels": "meganeura.kernels",
            "kernels/attention": "meganeura.kernels.attention", "runtime": "meganeura.runtime"}
CITED = re.compile(r"(?<![\w.])(?:torch_)?meganeura(?:\.[A-Za-z_]\w*)+")


def prose(source: str) -> list[tuple[int, str]]:
    """The docstrings (module, class, function) and comments of ``source``, each with its first line."""
    texts = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                texts.append((body[0].lineno, body[0].value.value))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            texts.append((token.start[0], token.string))
    return texts


def resolves(name: str) -> bool:
    """``name`` is a module, or an attribute (a chain of them) of the longest module it starts with."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name is None or not (module == err.name or module.startswith(err.name + ".")):
                raise  # the module exists and imports something missing: not a question of the citation
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def stale_names(source: str) -> list[tuple[int, str]]:
    """The names cited in ``source``'s docstrings and comments that resolve to nothing, with their lines."""
    return [(line, name) for line, text in prose(source) for name in CITED.findall(text) if not resolves(name)]


def _files():
    for folder in FOLDERS:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_every_cited_name_exists():
    stale = [f"{file.relative_to(ROOT)}:{line}: {name}" for file in _files()
             for line, name in stale_names(file.read_text())]
    assert not stale, "docstrings or comments cite names that do not exist:\n" + "\n".join(stale)


def test_a_stale_citation_is_found():
    source = '''"""Sizes live in ``meganeura.runtime.sizes`` (they moved to ``meganeura.kernels.sizes``)."""
def f():
    """Returns a ``meganeura.kernels.sizes.Size``, not a ``meganeura.kernels.sizes.Sighs``."""
    return 1  # see torch_meganeura.explain and torch_meganeura.gone_away
x = "meganeura.runtime.nowhere"  # a string in code is not prose; only comments and docstrings are read
'''
    assert stale_names(source) == [(1, "meganeura.runtime.sizes"), (3, "meganeura.kernels.sizes.Sighs"),
                                   (4, "torch_meganeura.gone_away")]


@pytest.mark.parametrize("folder", list(PACKAGES))
def test_each_package_index_names_every_module(folder):
    """A package's ``__init__`` docstring names each of its modules and subpackages (as ``name``)."""
    path = ROOT / folder
    index = ast.get_docstring(ast.parse((path / "__init__.py").read_text())) or ""
    named = set(re.findall(r"``([\w.]+)``", index))
    modules = {p.stem for p in path.glob("*.py") if p.stem != "__init__"}
    modules |= {p.parent.name for p in path.glob("*/__init__.py")}
    missing = sorted(m for m in modules if m not in named and f"{PACKAGES[folder]}.{m}" not in named)
    assert not missing, f"{folder}/__init__.py's docstring does not name {missing}"
