"""The packages' layering, read with ``ast`` from every import statement (and literal import_module / __import__
call) of every module file: the runtime never imports torch, and imports flow one way, torch_meganeura -> lowering
-> kernels, with runtime beside them:
  runtime   torch-free; may import kernels (a limit name, the matmul tuner's candidates), never lowering or
            torch_meganeura;
  kernels   generates WGSL from values it is given (limits, shapes): imports no other package of the project;
  lowering  torch-free; imports kernels, and of runtime only the plan format it emits (``PLAN_FORMAT``).
Within torch_meganeura, its subpackages are layers too (``TORCH_GROUPS``, lowest first): lower (aten -> IR), tensors,
backend, training, bundles (export), coverage; a module imports its own group and lower ones."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "runtime"
PACKAGES = {"runtime": "meganeura.runtime", "kernels": "meganeura.kernels", "lowering": "meganeura.lowering"}
PLAN_FORMAT = ("meganeura.runtime.plan", "meganeura.runtime.dtypes")  # the plan lowering emits, and its dtypes
FORBIDDEN = {
    "runtime": ("torch", "torch_meganeura", "meganeura.lowering"),
    "kernels": ("torch", "torch_meganeura", "meganeura.lowering", "meganeura.runtime"),
    "lowering": ("torch", "torch_meganeura", "meganeura.runtime"),
}


def _imported_modules(tree: ast.AST, package: str = ""):
    """The modules a module imports; ``from m import a`` gives m.a (a submodule or a name in m), relative imports
    resolved against ``package``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            yield from (f"{base}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)):
            yield str(node.args[0].value)


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _imports(folder: str):
    """(file, imported module) of every import in the package in ``folder``."""
    files = sorted((ROOT / folder).rglob("*.py"))
    assert len(files) >= 5  # the walk found the package
    for file in files:
        parts = file.relative_to(ROOT / folder).parent.parts  # the module's package, below the package's root
        package = ".".join([PACKAGES[folder], *parts])
        for module in _imported_modules(ast.parse(file.read_text(), str(file)), package):
            yield file.relative_to(ROOT), module


def test_runtime_modules_do_not_import_torch():
    assert len(list(RUNTIME.rglob("*.py"))) >= 10  # bundle, cli, model, program, ... included
    offenders = [f"{file}: {module}" for file, module in _imports("runtime") if _within(module, "torch")]
    assert not offenders, f"runtime modules import torch: {offenders}"


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_imports_flow_one_way(folder):
    offenders = [f"{file}: {module}" for file, module in _imports(folder)
                 if any(_within(module, banned) for banned in FORBIDDEN[folder])
                 and not (folder == "lowering" and any(_within(module, f) for f in PLAN_FORMAT))]
    assert not offenders, f"{folder} imports what it must not: {offenders}"


def test_the_check_sees_every_import_form():
    source = "import torch.nn\nfrom torch import nn\nimportlib.import_module('torch')\n__import__('torch.fx')"
    assert list(_imported_modules(ast.parse(source))) == ["torch.nn", "torch.nn", "torch", "torch.fx"]
    relative = "from ..matmul import fold_grid\nfrom . import wgsl\nfrom .plans import AttentionShape"
    assert list(_imported_modules(ast.parse(relative), "meganeura.kernels.attention")) == [
        "meganeura.kernels.matmul.fold_grid", "meganeura.kernels.attention.wgsl",
        "meganeura.kernels.attention.plans.AttentionShape"]


# torch_meganeura's subpackages, lowest first: a module may import its own group and the groups before it, never
# one after it. The package's top level (``__init__``, ``demo``) may import any.
TORCH_GROUPS = ("lower", "tensors", "backend", "training", "bundles", "coverage")


def _upward_imports(file: str, source: str, package: str) -> list[str]:
    """The imports of one torch_meganeura module (in ``package``) that point to a higher group than its own."""
    own = package.split(".")[1] if package.count(".") else None
    if own not in TORCH_GROUPS:
        return []
    upward = []
    for module in _imported_modules(ast.parse(source, file), package):
        parts = module.split(".")
        if parts[0] == "torch_meganeura" and len(parts) > 1 and parts[1] in TORCH_GROUPS:
            if TORCH_GROUPS.index(parts[1]) > TORCH_GROUPS.index(own):
                upward.append(f"{file}: {module}")
    return upward


def test_torch_meganeura_groups_import_downward_only():
    files = sorted((ROOT / "torch_meganeura").rglob("*.py"))
    groups = {f.relative_to(ROOT / "torch_meganeura").parts[0] for f in files}
    assert set(TORCH_GROUPS) <= groups, f"subpackages missing: {set(TORCH_GROUPS) - groups}"
    offenders = []
    for file in files:
        package = ".".join(("torch_meganeura", *file.relative_to(ROOT / "torch_meganeura").parent.parts))
        offenders += _upward_imports(str(file.relative_to(ROOT)), file.read_text(), package)
    assert not offenders, f"torch_meganeura modules import a higher group: {offenders}"


def test_an_upward_import_is_found():
    """A deliberate break: a lowering that imports the training step, and a device tensor that imports the backend."""
    assert _upward_imports("lower/x.py", "from ..training.step import TrainStep", "torch_meganeura.lower") == [
        "lower/x.py: torch_meganeura.training.step.TrainStep"]
    assert _upward_imports("tensors/y.py", "import torch_meganeura.backend.entry", "torch_meganeura.tensors") == [
        "tensors/y.py: torch_meganeura.backend.entry"]
    assert _upward_imports("training/z.py", "from ..backend import entry\nfrom . import roles",
                           "torch_meganeura.training") == []
