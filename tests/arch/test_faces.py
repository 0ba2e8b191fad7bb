"""Concepts, not line counts, make modules; the wheel carries the product.

- Every folder of ``precast/`` is a section of docs/architecture.md (``### precast/<folder>/``), and a folder
  whose ``__init__.py`` declares a public face (``__all__``) has each name of it in that section, in backticks;
  each name of ``__all__`` is bound in the ``__init__.py`` (a face that names what it does not hold fails on
  ``from ... import *``).
- A subpackage (a folder below a layer's folder: a concept grouped, such as ``numerics/calibration/``) declares
  its face, except the engine folders of ``backends/`` (reached through ``precast.compile``'s dispatch).
- The wheel (setuptools' package discovery as pyproject.toml configures it) ships ``precast`` only, every folder
  of it, and under ``precast/bench/`` only what ``precast bench`` runs: each module there is imported, at any
  depth (inside functions too), starting from the command's module ``precast.cli.bench``. A harness only a
  source checkout runs (an optional environment's builder, a model with real weights) lives in ``benchmarks/``.
- pyproject.toml names only files that exist (its extras' comments point at the scripts that use them).

Modules have no line limit any more: a module holds one concept whatever its size; functions stay within 60
lines (``test_functions.py``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "precast"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
ENGINE_FOLDERS = ("backends/aoti", "backends/onnx", "backends/openvino")
# folders that predate the rule and declare no face yet (each one line why); the list only shrinks
NO_FACE_YET = {
    "policy/rules": "its modules are imported one by one (policy.py, decide.py); a face is to be chosen"
}


def folders() -> list[str]:
    """Every package folder of precast/, relative to it ("" for precast/ itself)."""
    found = [p.parent.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("__init__.py")]
    return sorted("" if f == "." else f for f in found if "__pycache__" not in f)


def sections(text: str) -> dict[str, str]:
    """docs/architecture.md's ``### precast/<folder>/`` sections: folder -> its text up to the next heading."""
    out, folder, body = {}, None, []
    for line in text.splitlines():
        heading = re.match(r"^###\s+`?precast/([\w/]*?)/?`?\s*$", line)
        if heading or line.startswith(("## ", "### ")):
            if folder is not None:
                out[folder] = "\n".join(body)
            folder, body = (heading.group(1) if heading else None), []
            continue
        body.append(line)
    if folder is not None:
        out[folder] = "\n".join(body)
    return out


def face(init: Path) -> list[str] | None:
    """The names ``__all__`` lists in an ``__init__.py``, or None where it declares none."""
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return [ast.literal_eval(e) for e in node.value.elts]
    return None


def bound_names(init: Path) -> set[str]:
    """Names a module binds at its top level: imports, definitions, assignments."""
    names: set[str] = set()
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def lazy(init: Path) -> bool:
    """A module ``__getattr__`` (PEP 562) binds names on first use: its face is not read statically."""
    return any(
        isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in ast.parse(init.read_text()).body
    )


def face_problems(text: str) -> list[str]:
    documented = sections(text)
    problems = []
    for folder in folders():
        shown = f"precast/{folder}/" if folder else "precast/"
        if folder not in documented:
            problems.append(f"{shown}: no '### {shown}' section in docs/architecture.md")
            continue
        init = PACKAGE / folder / "__init__.py"
        names = face(init)
        if names is None:
            deep = folder.count("/") >= 1
            if deep and folder not in ENGINE_FOLDERS and folder not in NO_FACE_YET:
                problems.append(f"{shown}__init__.py: a subpackage declares its public face (__all__)")
            continue
        unbound = sorted(set(names) - bound_names(init))
        if unbound and not lazy(init):
            problems.append(f"{shown}__init__.py: __all__ names what it does not bind: {unbound}")
        missing = [n for n in names if f"`{n}`" not in documented[folder]]
        if missing:
            problems.append(f"{shown}: docs/architecture.md's section does not name its face: {missing}")
    return problems


def test_every_folder_has_a_documented_face():
    problems = face_problems(ARCHITECTURE.read_text())
    assert not problems, "\n".join(problems)


def test_the_face_check_can_fail():
    assert sections("### precast/ir/\nx `Program`\n### precast/bench/decode/\n`Shape`\n## Next\ny\n") == {
        "ir": "x `Program`",
        "bench/decode": "`Shape`",
    }
    text = ARCHITECTURE.read_text()
    dropped = re.sub(r"`run_decode_bench`", "run_decode_bench", text)
    assert any("run_decode_bench" in p for p in face_problems(dropped))
    no_section = re.sub(r"(?m)^### precast/bench/decode/$", "### Decode", text)
    assert any(
        "precast/bench/decode/: no '### precast/bench/decode/' section" in p
        for p in face_problems(no_section)
    )


# ---- the wheel ---------------------------------------------------------------------------------------------------
def module_file(name: str) -> Path | None:
    """The file of module ``precast.a.b``: a.b.py or a/b/__init__.py; None when it is not a module."""
    rel = Path(*name.split(".")[1:]) if "." in name else Path()
    for path in (PACKAGE / rel.with_suffix(".py") if rel.parts else None, PACKAGE / rel / "__init__.py"):
        if path is not None and path.exists():
            return path
    return None


def imported_modules(path: Path, name: str) -> set[str]:
    """Every precast module an import in ``path`` runs, at any depth: the module named, its parent packages
    (their ``__init__`` runs first), and ``from A import X`` where X is a submodule of A."""
    found: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            bases = [a.name for a in node.names]
            subs: list[str] = []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
            bases, subs = [base], [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for module in bases + subs:
            parts = module.split(".")
            if parts[0] != "precast":
                continue
            found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return {m for m in found if module_file(m) is not None}


def reached_from(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo += sorted(imported_modules(module_file(module), module) - seen)
    return seen


def bench_modules() -> set[str]:
    return {
        ".".join(("precast", *p.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
        for p in (PACKAGE / "bench").rglob("*.py")
        if "__pycache__" not in p.parts
    }


def test_the_wheel_ships_precast_whole_and_only_precast():
    import setuptools

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    shipped = set(setuptools.find_packages(where=str(ROOT), **find))
    expected = {".".join(("precast", *f.split("/"))) if f else "precast" for f in folders()}
    assert shipped == expected, f"shipped {sorted(shipped ^ expected)} differ from precast/'s folders"
    assert not any(p.split(".")[0] in ("benchmarks", "tests") for p in shipped)


def unused(modules: set[str], start: str) -> list[str]:
    return sorted(modules - reached_from(start))


def test_bench_ships_only_what_precast_bench_runs():
    """Every module of precast/bench/ is reached from ``precast.cli.bench`` through its imports."""
    found = unused(bench_modules(), "precast.cli.bench")
    assert not found, (
        f"precast/bench holds modules `precast bench` never imports: {found}; a harness only a source "
        "checkout runs belongs in benchmarks/harness/"
    )


def test_the_bench_rule_sees_an_unused_module():
    """A script run by path (the anchor environment's ov_anchor.py once was) is no import: it is found; modules
    reached only inside functions or as ``from package import module`` count as run."""
    assert unused(bench_modules() | {"precast.bench.ov_anchor"}, "precast.cli.bench") == [
        "precast.bench.ov_anchor"
    ]
    reached = reached_from("precast.cli.bench")
    assert {"precast.bench.decode.rss", "precast.bench.convert.gb", "precast.bench.models"} <= reached


def test_pyproject_names_only_files_that_exist():
    text = (ROOT / "pyproject.toml").read_text()
    named = set(re.findall(r"(?<![\w/.])((?:benchmarks|tests|docs|precast)/[\w/.-]*\w\.(?:py|md))", text))
    assert "benchmarks/harness/minilm.py" in named  # the minilm extra's script
    gone = sorted(p for p in named if not (ROOT / p).exists())
    assert not gone, f"pyproject.toml names files that do not exist: {gone}"
