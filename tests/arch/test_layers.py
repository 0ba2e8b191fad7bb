"""The one-way architecture, enforced: a module imports only its own layer or lower (read with ``ast``, imports
inside functions included), and no two modules import each other, directly or in a cycle.

Layers, lowest first (docs/architecture.md): base (errors, dtypes, codes, metrics, memory, paths, io, entries, progress, examples, threads, cpu, version) ->
ir -> policy -> passes -> numerics, weights -> pipeline -> report -> api -> runtime -> backends -> bench -> cli (and
the ``precast`` facade). Inside ``backends/``, one folder (or module) per engine: an engine never imports another,
and ``backends/__init__.py`` is ``compile()``'s dispatch only.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "precast"

LAYERS = (
    (
        "base",
        (
            "errors",
            "dtypes",
            "codes",
            "metrics",
            "paths",
            "io",
            "entries",
            "progress",
            "examples",
            "threads",
            "cpu",
            "version",
            "optional",
            "memory",
            "interrupts",
        ),
    ),
    ("ir", ("ir",)),
    ("policy", ("policy",)),
    ("passes", ("passes",)),
    ("numerics", ("numerics", "weights")),  # one layer: neither needs the other's code
    ("pipeline", ("pipeline",)),
    ("report", ("report",)),
    ("api", ("api", "guard", "explain", "explain_weights")),
    ("runtime", ("runtime",)),  # the call contract every engine and llm/ share, below them
    ("backends", ("backends", "llm", "__init__")),  # the precast facade re-exports api and backends
    ("bench", ("bench",)),
    ("cli", ("cli", "__main__")),
)
RANK = {first: i for i, (_, firsts) in enumerate(LAYERS) for first in firsts}
NAME = {i: name for i, (name, _) in enumerate(LAYERS)}
# precast/quant/ (weight formats) is one concept spanning layers: each of its modules is placed on its own layer
# (a format is ir-level data, the graph writer is a pass, the estimator runs the program, the budget is a
# conversion stage, the sensitivity runs conversions). Its face (__init__) imports the ir-level modules only.
QUANT = {
    "__init__": "ir",
    "formats": "ir",
    "rules": "ir",
    "forms": "ir",
    "presets": "ir",
    "rounding": "ir",  # data-aware int4 rounding (agent H8)
    "activation_stats": "ir",
    "graph": "passes",
    "probes": "numerics",
    "estimate": "numerics",
    "fit": "numerics",
    "budget": "pipeline",
    "sensitivity": "api",
}
_BY_NAME = {name: i for i, name in NAME.items()}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """precast.X.Y -> rank of X; the package itself (precast/__init__.py) is the facade, top layer."""
    parts = module.split(".")
    if parts == ["precast"]:
        return RANK["__init__"]
    if parts[1] == "quant":
        sub = parts[2] if len(parts) > 2 else "__init__"
        if sub not in QUANT:
            raise AssertionError(f"{module}: no layer for it; add it to QUANT (and to docs)")
        return _BY_NAME[QUANT[sub]]
    if parts[1] not in RANK:
        raise AssertionError(f"{module}: no layer for precast.{parts[1]}; add it to LAYERS (and to docs)")
    return RANK[parts[1]]


def type_only(tree: ast.AST) -> set[ast.AST]:
    """The statements under ``if TYPE_CHECKING:``: names for annotations, never imported when the code runs
    (import-linter's ``exclude_type_checking_imports``). A lower layer may name a higher one's value type in an
    annotation (the policy's ``calibration: Calibration``), never call it."""
    out: set[ast.AST] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.If)
            and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
        ):
            out |= {n for stmt in node.body for n in ast.walk(stmt)}
    return out


def imports_of(source: str, module: str, is_package: bool) -> list[tuple[str, int]]:
    """(imported precast module, line) for every import statement, at any depth (not those under
    ``if TYPE_CHECKING:``, which never run)."""
    found = []
    tree = ast.parse(source)
    skip = type_only(tree)
    for node in ast.walk(tree):
        if node in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "precast"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([node.module] if node.module else []))
            if base.split(".")[0] != "precast":
                continue
            folder = PACKAGE.parent.joinpath(*base.split("."))
            # from precast[.pkg] import X: X is a submodule, or a name of the package's face
            if folder.is_dir():
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    is_module = (folder / a.name).exists() or (folder / f"{a.name}.py").exists()
                    found.append((sub if is_module else base, node.lineno))
            else:
                found.append((base, node.lineno))
    return found


def upward_imports(files: dict[str, tuple[str, bool]]) -> list[str]:
    problems = []
    for module, (source, is_package) in sorted(files.items()):
        mine = layer_of(module)
        for target, line in imports_of(source, module, is_package):
            theirs = layer_of(target)
            if theirs > mine:
                problems.append(
                    f"{module}:{line} imports {target}: layer {NAME[mine]} may not import layer {NAME[theirs]}"
                )
    return problems


def package_files() -> dict[str, tuple[str, bool]]:
    return {module_name(p): (p.read_text(), p.name == "__init__.py") for p in sorted(PACKAGE.rglob("*.py"))}


def test_no_upward_imports():
    problems = upward_imports(package_files())
    assert not problems, "upward imports:\n" + "\n".join(problems)


def test_every_module_has_a_layer_and_a_docstring():
    for module, (source, _) in package_files().items():
        layer_of(module)
        assert ast.get_docstring(ast.parse(source)), (
            f"{module}: open with a docstring naming its stage and I/O"
        )


def test_no_import_cycles():
    files = package_files()
    graph = {
        m: {t for t, _ in imports_of(src, m, pkg) if t in files and t != m and t != "precast"}
        for m, (src, pkg) in files.items()
    }
    cycles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(" -> ".join(stack[stack.index(t) :] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize(
    "module, source, expected",
    [
        (
            "precast.ir.program",
            "from precast.passes.classify import classify\n",
            "layer ir may not import layer passes",
        ),
        (
            "precast.policy.base",
            "def f():\n    from precast.api import convert\n",
            "layer policy may not import layer api",
        ),
        (
            "precast.passes.fold",
            "from ..report import build\n",
            "layer passes may not import layer report",
        ),
        ("precast.ir.graph", "from precast import api\n", "layer ir may not import layer api"),
        (  # precast/quant/ spans layers: each of its modules on its own (QUANT)
            "precast.quant.formats",
            "from precast.quant.graph import quantize_weights\n",
            "layer ir may not import layer passes",
        ),
        (
            "precast.quant.graph",
            "from precast.quant import sensitivity\n",
            "layer passes may not import layer api",
        ),
    ],
)
def test_an_upward_import_is_caught(module, source, expected):
    """The check fails on an upward import, at module level, inside a function, relative or from the package."""
    (problem,) = upward_imports({module: (source, False)})
    assert expected in problem and module in problem


def test_type_only_imports_are_not_dependencies():
    """An import under ``if TYPE_CHECKING:`` names a type for annotations; one outside it is checked."""
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from precast.api import ConvertResult\n"
    )
    assert not upward_imports({"precast.policy.base": (source, False)})
    (problem,) = upward_imports(
        {"precast.policy.base": (source.replace("if TYPE_CHECKING:\n    ", ""), False)}
    )
    assert "layer policy may not import layer api" in problem


def test_downward_and_same_layer_imports_pass():
    assert not upward_imports(
        {"precast.api": ("from precast.pipeline import checks\nfrom precast import errors\n", False)}
    )
    assert not upward_imports(
        {"precast.passes.fold": ("from precast.passes.rewrite import insert_casts\n", False)}
    )


ENGINES = ("aoti", "openvino", "onnx", "executorch")


def engine_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "backends" and parts[2] in ENGINES else None


def cross_engine_imports(files: dict[str, tuple[str, bool]]) -> list[str]:
    problems = []
    for module, (source, is_package) in sorted(files.items()):
        mine = engine_of(module)
        for target, line in imports_of(source, module, is_package):
            theirs = engine_of(target)
            if mine and theirs and theirs != mine:
                problems.append(
                    f"{module}:{line} imports {target}: engine {mine} may not import engine {theirs}"
                )
    return problems


def test_engines_are_siblings():
    """One folder per engine under ``backends/``, each its own: what two engines share lives below them
    (``precast/runtime/``, ``ir/``), never in one engine for the other to import."""
    files = package_files()
    folders = {p.name for p in (PACKAGE / "backends").iterdir() if p.is_dir() and p.name != "__pycache__"}
    modules = {p.stem for p in (PACKAGE / "backends").glob("*.py")} - {"__init__", "registry"}
    assert folders | modules == set(ENGINES), f"backends/ holds engines only: {sorted(folders | modules)}"
    assert not cross_engine_imports(files), "\n".join(cross_engine_imports(files))
    assert cross_engine_imports(
        {
            "precast.backends.openvino.model": (
                "from precast.backends.aoti.model import CompiledModel\n",
                False,
            )
        }
    ), "the check must see an engine importing another"


def test_backends_init_is_the_dispatch_only():
    tree = ast.parse((PACKAGE / "backends" / "__init__.py").read_text())
    defs = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert defs == ["compile"], (
        f"backends/__init__.py defines {defs}: only compile()'s dispatch belongs there"
    )


def test_every_package_folder_is_a_regular_package():
    """A folder of modules without ``__init__.py`` imports from a checkout (a namespace package) but is left out
    of the wheel (``setuptools.packages.find`` finds regular packages only): users would get ImportError."""
    folders = {p.parent for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    missing = sorted(str(f.relative_to(PACKAGE.parent)) for f in folders if not (f / "__init__.py").exists())
    assert not missing, f"add __init__.py to: {missing}"


def test_stages_run_in_the_documented_order():
    """``precast.passes.STAGES`` is what a conversion runs, in that order: observed on a real conversion
    (policy auto with a tolerance: every optional stage runs), each stage name is documented and the first
    appearances follow the list."""
    import torch

    import precast
    from precast.passes import STAGES
    from precast.passes.runner import observe
    from tests import models as zoo

    seen: list[str] = []

    def observer(name):
        seen.append(name)
        import contextlib

        return contextlib.nullcontext()

    model, inputs = zoo.plain_encoder()
    calib = [(torch.randn_like(inputs[0]),) for _ in range(2)]
    latencies = {}  # nothing measured: every op keeps the rules' answer, no timing in a test
    with observe(observer):
        precast.convert(
            model,
            inputs,
            policy=precast.AutoPolicy(
                dtype=torch.bfloat16, calibration=calib, tolerance={"cosine": 0.999}, latencies=latencies
            ),
        )
    names = [n for n in dict.fromkeys(seen) if n != "check_pass"]
    assert set(names) <= set(STAGES), set(names) - set(STAGES)
    assert names == [s for s in STAGES if s in names]
    assert {"capture", "calibrate", "tolerance", "classify", "report", "device_check", "verify"} <= set(names)


def test_no_private_names_imported_across_modules():
    """A name another module needs is promoted (no leading underscore), not imported private."""
    found = []
    for module, (source, _) in package_files().items():
        for node in ast.walk(ast.parse(source)):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("precast")):
                continue
            found += [
                f"{module} <- {node.module}.{a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            ]
    assert not found, found


def test_driver_and_pipeline_never_ask_a_policy_its_class():
    """api.py and the driver, passes, numerics and weights reach policies through hooks (precast.policy.hooks), never ``isinstance`` on a
    policy or decider class, so a policy of the user's gets what the built-in ones get."""
    classes = {"TorchPolicy", "RulesPolicy", "AutoPolicy", "RulesDecider", "AutoDecider"}
    found = []
    for module, (source, _) in package_files().items():
        if module != "precast.api" and not module.startswith(
            ("precast.pipeline", "precast.passes", "precast.numerics", "precast.weights")
        ):
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                found += [f"{module}:{node.lineno}" for _ in names & classes]
    assert not found, found


def test_the_package_never_names_the_source_checkout():
    """``precast/`` is self-contained: no import of, and no string naming, ``benchmarks`` (a wheel has none; the
    benchmark scripts use the package's harness, never the reverse)."""
    found = []
    for module, (source, _) in package_files().items():
        for node in ast.walk(ast.parse(source)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = re.findall(r"(?<![\w/])benchmarks[./]\w+", node.value)  # not docs/benchmarks/
            found += [f"{module}:{node.lineno}: {n}" for n in names if re.match(r"benchmarks\b", n)]
    assert not found, found


def test_no_locals_in_the_package():
    """Options are passed by name, never picked out of ``locals()`` (renaming a keyword would drop it)."""
    found = [
        f"{module}:{node.lineno}"
        for module, (source, _) in package_files().items()
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) in ("locals", "vars")
        and not node.args
    ]
    assert not found, found
