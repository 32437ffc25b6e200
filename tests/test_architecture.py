"""The dependency direction of docs/architecture.md holds: imports only point down the stack.

Every module of pyxllm belongs to a unit: a package (``engine``, ``executor`` ...), a shared
module (``config``, ``sampling_params``, ``outputs``), the command line (``cli``: the
``pyxllm`` command, ``pyxllm/cli/`` and ``__main__.py``, at the top) or the package itself
(``pyxllm/__init__.py``). Each
unit may import only the units of its row in :data:`ALLOWED`; imports inside function bodies
count, and so do modules named by a string (``"pyxllm.attention.torch_paged:..."``, loaded by
``importlib``).
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import re
import textwrap

import pyxllm

ROOT = pathlib.Path(pyxllm.__file__).parent
SHARED = {
    "config",
    "speculative_config",
    "sampling_params",
    "pooling_params",
    "lora_request",
    "multimodal_inputs",
    "outputs",
    "flag_fields",
    "flag_types",
}
# The pyxllm command (the package pyxllm/cli/, and these modules): it binds every other unit
# (the benchmarks' subcommands included), and no other unit imports it.
CLI_MODULES = {"__main__.py"}
ALLOWED = {
    "lazy_exports": set(),  # PEP 562 package attributes, for the packages below
    "kernels": set(),
    "distributed": set(),
    "weights": {"lazy_exports"},
    "sampling_params": set(),
    "pooling_params": set(),
    "lora_request": set(),
    "multimodal_inputs": set(),
    "speculative_config": set(),
    "outputs": set(),
    "flag_fields": set(),  # a field's flag metadata
    "flag_types": set(),  # converters of flag text
    # parses --master-addr with distributed's parser, and --speculative-config
    "config": {"distributed", "speculative_config", "flag_fields", "flag_types"},
    "layers": {"kernels", "distributed"},
    "models": {"layers", "kernels", "distributed"},
    "attention": {"kernels", "layers", "distributed"},
    # LoRA adapters laid onto a loaded model's layers (the executor holds them)
    "lora": {"layers", "kernels"} | SHARED,
    # a platform names its kernel package and attention backends; the executor loads them
    "platforms": {"kernels", "attention", "distributed"} | SHARED,
    "executor": {
        "models",
        "layers",
        "lora",
        "attention",
        "kernels",
        "platforms",
        "weights",
        "distributed",
    }
    | SHARED,
    "engine": {"executor", "platforms", "weights", "distributed"} | SHARED,
    "entrypoints": {"engine", "platforms", "weights", "distributed"} | SHARED,
    "benchmarks": {"entrypoints", "engine", "platforms", "weights"} | SHARED,
    "cli": {
        "entrypoints",
        "benchmarks",
        "engine",
        "executor",
        "platforms",
        "weights",
        "distributed",
    }
    | SHARED,
    "pyxllm": {"entrypoints", "lazy_exports"} | SHARED,
}
# A module path in a string: "pyxllm.attention.torch_paged" or "pyxllm.x.y:Class".
_MODULE_STRING = re.compile(r"pyxllm(\.\w+)+(:\w+)?")


def unit_of(rel: str) -> str:
    """The unit of the module at ``rel`` (a path relative to the package, ``/``-separated)."""
    if rel in CLI_MODULES:
        return "cli"
    if rel == "__init__.py":
        return "pyxllm"
    return rel.split("/")[0].removesuffix(".py")


def _target(dotted: str) -> str:
    """The unit a ``pyxllm.*`` name belongs to (a module, or a name inside one)."""
    parts = dotted.split(":")[0].split(".")[1:]
    for end in range(1, len(parts) + 1):
        if "/".join(parts[:end]) + ".py" in CLI_MODULES:
            return "cli"
    return parts[0]


def _is_module(dotted: str) -> bool:
    """Whether ``"pyxllm.a.b"`` (or ``"pyxllm.a.b:Name"``) names a module of the package (a
    logger name such as ``"pyxllm.worker"`` does not)."""
    path = ROOT.joinpath(*dotted.split(":")[0].split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_units(source: str, module: str) -> set[str]:
    """The units that ``source`` (the module ``pyxllm.<module>``) imports: ``import`` and
    ``from`` statements anywhere (function bodies included; relative ones resolved) and module
    paths written as strings."""
    found = set()
    package = module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - node.level + 1]
                base = ".".join(["pyxllm", *parent, *filter(None, [base])])
            names = [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _MODULE_STRING.fullmatch(node.value) and _is_module(node.value):
                names = [node.value]
        found |= {_target(n) for n in names if n.startswith("pyxllm.")}
    return found


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        module = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        yield rel, module, path


def test_every_module_belongs_to_a_unit_with_a_row():
    missing = {unit_of(rel) for rel, _, _ in _modules()} - set(ALLOWED)
    assert not missing, f"give these a row in ALLOWED: {sorted(missing)}"


def test_imports_point_down_the_stack():
    violations = []
    for rel, module, path in _modules():
        unit = unit_of(rel)
        for target in imported_units(path.read_text(), module) - {unit} - ALLOWED[unit]:
            violations.append(f"{rel} ({unit}) imports pyxllm.{target}")
    assert not violations, "\n".join(violations)


def test_the_allowed_imports_have_no_cycle():
    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in ALLOWED[start] - seen:
            if nxt == goal or reaches(nxt, goal, seen | {nxt}):
                return True
        return False

    cycles = [unit for unit in ALLOWED if reaches(unit, unit, set())]
    assert not cycles, cycles


def test_the_collector_sees_every_kind_of_import():
    source = (
        "import pyxllm.engine.scheduler\n"
        "def f():\n"
        "    from pyxllm.executor import multiproc\n"
        "    from ..weights import loader\n"
        "    from . import metrics\n"
        "BACKEND = 'pyxllm.attention.torch_paged:TorchPagedAttentionBackend'\n"
        "from pyxllm import config\n"
        "from pyxllm.cli import main\n"
    )
    found = imported_units(source, "benchmarks.serve")
    assert found == {"engine", "executor", "weights", "benchmarks", "attention", "config", "cli"}


def module_imports(source: str, module: str, known: set[str], siblings: str = "") -> set[str]:
    """The modules of ``known`` that ``source`` (the module ``module``, dotted) imports, at
    the top or in a function body, but not under ``if TYPE_CHECKING:`` (never run). With
    ``siblings`` (a package name), ``import x`` may also name ``siblings.x`` (the benchmark
    scripts import each other so)."""
    package = module.split(".")[:-1]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *filter(None, [base])])
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        for name in names:
            for candidate in (name, f"{siblings}.{name}" if siblings else ""):
                if candidate in known and candidate != module:
                    found.add(candidate)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def import_cycle(root: pathlib.Path, package: str, siblings: str = "") -> list[str] | None:
    """One chain of modules under ``root`` (the package ``package``) that imports its own
    start, or ``None``."""
    paths = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("").as_posix().removesuffix("/__init__")
        paths[".".join(filter(None, [package, rel.replace("/", ".").removesuffix("__init__")]))] = (
            path
        )
    graph = {m: module_imports(p.read_text(), m, set(paths), siblings) for m, p in paths.items()}
    done: set[str] = set()

    def search(module: str, chain: list[str]) -> list[str] | None:
        if module in chain:
            return chain[chain.index(module) :] + [module]
        if module in done:
            return None
        for target in sorted(graph[module]):
            cycle = search(target, [*chain, module])
            if cycle:
                return cycle
        done.add(module)
        return None

    return next(filter(None, (search(m, []) for m in graph)), None)


def test_no_module_imports_itself_through_others():
    """No import circle between modules, function-body imports included, in the package and
    in the benchmark scripts."""
    assert import_cycle(ROOT, "pyxllm") is None, " -> ".join(import_cycle(ROOT, "pyxllm"))
    scripts = ROOT.parent / "benchmarks"
    cycle = import_cycle(scripts, "benchmarks", siblings="benchmarks")
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_function_body_circle(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    import c\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nimport a\n")
    assert import_cycle(tmp_path, "s", siblings="s") == ["s.a", "s.b", "s.c", "s.a"]
    (tmp_path / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n"
    )
    assert import_cycle(tmp_path, "s", siblings="s") is None


# Device names live in platforms/, kernels/, attention/ and the executor's runner choice.
DEVICE_WORDS = ("torch.cuda", "torch_npu", "torch_mlu", '"cuda"', '"npu"', '"mlu"', ".is_cuda")
DEVICE_FREE = ("layers", "models", "engine", "executor")
DEVICE_ALLOWED_IN = {"executor/runners"}  # a graph capture names what it records


def test_layers_models_engine_and_executor_hold_no_device_branch():
    offenders = []
    for package in DEVICE_FREE:
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if any(rel.startswith(prefix + "/") for prefix in DEVICE_ALLOWED_IN):
                continue
            lines = path.read_text().splitlines()
            code = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
            offenders += [f"{rel}: {word}" for word in DEVICE_WORDS if word in code]
    assert not offenders, offenders


# the modules a command line, a client or the data-parallel router imports before any engine
# is built; none of them may load torch (seconds of start-up for `pyxllm --help`)
TORCH_FREE_MODULES = (
    "pyxllm",
    "pyxllm.config",
    "pyxllm.sampling_params",
    "pyxllm.outputs",
    "pyxllm.weights",
    "pyxllm.weights.source",
    "pyxllm.flag_fields",
    "pyxllm.cli.main",
    "pyxllm.cli.serve",
    "pyxllm.entrypoints.openai.server_options",
    "pyxllm.entrypoints.chat_cli",
    "pyxllm.entrypoints.openai.protocol",
    "pyxllm.engine.data_parallel.router",
)
SUBCOMMANDS = ("serve", "generate", "run-batch", "chat", "bench", "env", "check-device")


def test_the_command_line_and_its_help_load_no_torch():
    """Every subcommand's ``--help`` loads neither torch nor transformers, openai or fastapi
    (it answers in ~0.7 s), the modules above leave torch unloaded, and ``pyxllm.LLM`` (a
    lazy name) still resolves, and then loads it."""
    import subprocess
    import sys

    script = f"""
import contextlib, importlib, io, sys
from pyxllm.cli.main import main
for command in ([], *([c] for c in {SUBCOMMANDS!r})):
    sys.argv = ["pyxllm", *command, "--help"]
    with contextlib.redirect_stdout(io.StringIO()) as shown, contextlib.suppress(SystemExit):
        main()
    assert "usage: pyxllm" in shown.getvalue(), command
    heavy = {{"torch", "transformers", "openai", "fastapi"}} & set(sys.modules)
    assert not heavy, (command, heavy)  # each takes 0.5-3 s to import
for name in {TORCH_FREE_MODULES!r}:
    importlib.import_module(name)
    assert "torch" not in sys.modules, name
import pyxllm
assert pyxllm.LLM.__name__ == "LLM" and "torch" in sys.modules
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def _engine_attributes_used(source: str) -> set[str]:
    """The attribute names read off an engine in ``source``: ``engine.X``, ``self.engine.X``
    and ``app.state.engine.X``."""
    used = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id == "engine") or (
            isinstance(owner, ast.Attribute) and owner.attr == "engine"
        ):
            used.add(node.attr)
    return used


def _provided_members(cls) -> set[str]:
    """What ``cls`` itself provides: class-level names (those its bases up to the protocol
    define included) and the attributes its ``__init__`` assigns to ``self``."""
    from pyxllm.engine.protocol import EngineClient

    provided = set()
    for klass in cls.__mro__:
        if klass is EngineClient or klass is object:
            break
        provided |= set(vars(klass))
        init = klass.__dict__.get("__init__")
        if init is not None:
            tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
            for node in ast.walk(tree):
                targets = node.targets if isinstance(node, ast.Assign) else []
                for target in targets:
                    for leaf in target.elts if isinstance(target, ast.Tuple) else [target]:
                        if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name):
                            provided.add(leaf.attr)
    return provided


def test_the_server_uses_the_engine_only_through_engine_client():
    """The API server's layers (OpenAI's and Anthropic's routes) reach for no engine member
    that ``EngineClient`` does not declare, and both engines the server runs provide every
    member themselves (none falls back to the protocol's empty body)."""
    from pyxllm.engine.async_engine import AsyncEngine
    from pyxllm.engine.data_parallel.client import DataParallelEngine
    from pyxllm.engine.protocol import EngineClient

    members = {
        name
        for name in {*vars(EngineClient), *EngineClient.__annotations__}
        if not name.startswith("_")
    }
    assert {"generate", "input_processor", "metrics", "shutdown"} <= members
    used = set()
    for server_side in ("openai", "anthropic"):
        for path in (ROOT / "entrypoints" / server_side).rglob("*.py"):
            used |= _engine_attributes_used(path.read_text())
    assert used and used <= members, sorted(used - members)
    for cls in (AsyncEngine, DataParallelEngine):
        assert EngineClient in cls.__mro__
        assert not members - _provided_members(cls), (
            cls.__name__,
            members - _provided_members(cls),
        )


# entrypoints/openai/ is grouped by endpoint. The Responses API (and Anthropic's Messages, beside
# openai/) are served by translating into chat, so they may import chat; no endpoint package
# imports another otherwise, nor the app that assembles them (api_server).
ENDPOINT_PACKAGES = ("chat", "completions", "responses", "pooling", "tokenization", "middleware")
ENDPOINT_MAY_IMPORT = {"responses": {"chat", "middleware"}}


def test_openai_endpoint_packages_import_only_the_shared_modules():
    openai_root = ROOT / "entrypoints" / "openai"
    prefix = re.compile(r"pyxllm\.entrypoints\.openai\.(\w+)")
    violations = []
    for package in ENDPOINT_PACKAGES:
        allowed = ENDPOINT_MAY_IMPORT.get(package, set()) | {package}
        for path in (openai_root / package).rglob("*.py"):
            for name in prefix.findall(path.read_text()):
                forbidden = name in ENDPOINT_PACKAGES and name not in allowed
                if forbidden or name == "api_server":
                    violations.append(f"{path.relative_to(ROOT)} imports openai.{name}")
    assert not violations, "\n".join(violations)
