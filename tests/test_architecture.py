"""The package dependency direction of DESIGN.md holds: imports only point down the stack.

entrypoints -> engine -> executor -> models -> layers -> kernels; platforms bind kernels;
attention backends sit beside the executor; weights and distributed are shared services.
"""

from __future__ import annotations

import ast
import pathlib

import pyxllm

ROOT = pathlib.Path(pyxllm.__file__).parent
SHARED = {"config", "sampling_params", "outputs"}
ALLOWED = {
    "kernels": set(),
    "distributed": set(),
    "weights": set(),
    "layers": {"kernels", "distributed"},
    "models": {"layers", "kernels", "distributed"},
    "attention": {"kernels", "layers", "distributed"},
    "platforms": {"kernels", "distributed"} | SHARED,
    "executor": {"models", "layers", "attention", "kernels", "platforms", "weights", "distributed"}
    | SHARED,
    "engine": {"executor", "platforms", "weights", "distributed"} | SHARED,
    "benchmarks": {"engine", "executor", "platforms", "weights", "entrypoints"} | SHARED,
}


def _imported_packages(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = (
                [node.module]
                if node.module != "pyxllm"
                else [f"pyxllm.{a.name}" for a in node.names]
            )
        else:
            continue
        found |= {n.split(".")[1] for n in names if n.startswith("pyxllm.")}
    return found


def test_imports_point_down_the_stack():
    violations = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).parts
        package = rel[0] if len(rel) > 1 else None
        if package not in ALLOWED:
            continue
        for target in _imported_packages(path) - {package} - ALLOWED[package]:
            violations.append(f"{'/'.join(rel)} imports pyxllm.{target}")
    assert not violations, "\n".join(sorted(violations))


def test_layers_and_models_hold_no_device_branch():
    """Device names appear in platforms/, kernels/, attention/ and the executor, not in layers or
    models."""
    offenders = []
    for package in ("layers", "models"):
        for path in (ROOT / package).rglob("*.py"):
            if (
                path.name == "registry.py"
            ):  # the model x platform support matrix: data, not a branch
                continue
            code = "\n".join(
                line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")
            )
            for word in (
                "torch.cuda",
                "torch_npu",
                "torch_mlu",
                '"cuda"',
                '"npu"',
                '"mlu"',
                ".is_cuda",
            ):
                if word in code:
                    offenders.append(f"{package}/{path.name}: {word}")
    assert not offenders, offenders
