"""The runtime package never imports torch: every import statement (and literal import_module / __import__ call)
in every module file under runtime/ is read with ``ast``."""
import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"


def _imported_modules(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module or ""
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)):
            yield str(node.args[0].value)


def test_runtime_modules_do_not_import_torch():
    files = sorted(RUNTIME.rglob("*.py"))
    assert len(files) >= 10  # the walk found the package (bundle, cli, model, program, ... included)
    offenders = []
    for file in files:
        for module in _imported_modules(ast.parse(file.read_text(), str(file))):
            if module == "torch" or module.startswith("torch."):
                offenders.append(f"{file.relative_to(RUNTIME.parent)}: {module}")
    assert not offenders, f"runtime modules import torch: {offenders}"


def test_the_check_sees_every_import_form():
    source = "import torch.nn\nfrom torch import nn\nimportlib.import_module('torch')\n__import__('torch.fx')"
    assert list(_imported_modules(ast.parse(source))) == ["torch.nn", "torch", "torch", "torch.fx"]
