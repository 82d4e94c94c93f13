"""The tree's shape, as docs/architecture.md describes it: each place it names to add a model
family, attention backend, data-parallel engine or benchmark layout exists, with its guard test;
every package's docstring lists its modules; no module or function outgrows what one reader
holds."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 100


def _where_to_add_rows() -> list[tuple[str, list[str]]]:
    """``(what, [code spans])`` of each row of the "Where to add" table."""
    text = ARCHITECTURE.read_text()
    section = text.split("## Where to add", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[1] or set(cells[1]) <= {"-", " "} or cells[0] == "To add":
            continue
        rows.append((cells[0], re.findall(r"`([^`]+)`", " ".join(cells[1:]))))
    return rows


def _defined_names(path: Path) -> set[str]:
    """Top-level functions, classes and assignments of ``path``, and methods as ``Class.name``."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names |= {
                    f"{node.name}.{n.name}"
                    for n in node.body
                    if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                }
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def test_where_to_add_names_places_that_exist():
    rows = _where_to_add_rows()
    assert {what.lower() for what, _ in rows} >= {
        "a model family",
        "an attention backend",
        "a data-parallel engine",
        "a benchmark layout",
    }
    for what, spans in rows:
        places = [s for s in spans if "/" in s]
        assert places, f"{what}: names no file"
        assert any(s.startswith("tests/") for s in places), f"{what}: names no guarding test"
        for span in places:
            file, _, symbol = span.partition("::")
            path = ROOT / file
            assert path.exists(), f"{what}: {file} does not exist"
            if symbol:
                assert symbol in _defined_names(path), f"{what}: {file} defines no {symbol}"


def _modules(package: Path) -> list[str]:
    return sorted(
        p.stem if p.is_file() else p.name
        for p in package.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()
    )


@pytest.mark.parametrize(
    "package",
    sorted(
        str(p.parent.relative_to(ROOT / "tsp_ext"))
        for p in (ROOT / "tsp_ext").glob("*/**/__init__.py")
    ),
)
def test_package_docstring_names_every_module(package):
    path = ROOT / "tsp_ext" / package
    doc = ast.get_docstring(ast.parse((path / "__init__.py").read_text())) or ""
    missing = [m for m in _modules(path) if f"``{m}``" not in doc and f"``{m}.py``" not in doc]
    assert not missing, f"tsp_ext/{package}/__init__.py's docstring does not name {missing}"


def test_modules_and_functions_stay_small():
    too_long = []
    for path in sorted((ROOT / "tsp_ext").rglob("*.py")):
        source = path.read_text()
        name = path.relative_to(ROOT)
        if len(source.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, too_long


MAX_PARAMETERS = 8  # self / cls / ctx not counted; *args and **kwargs are one each
MAX_POSITIONAL = 4  # arguments a call to tsp_ext's own code passes by position (not *starred)


def _imported_modules(tree: ast.Module) -> set[str]:
    """Names a module binds by importing from outside tsp_ext (``torch``, ``F``, ``dist``, ...):
    calls through them are torch's (or another library's), not tsp_ext's."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            if not (node.module or "").startswith("tsp_ext"):
                names |= {a.asname or a.name for a in node.names}
    return names


def _callee(func: ast.expr) -> tuple[str | None, str | None]:
    """The called name (the last attribute or the name) and the name its chain starts from."""
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    root = func
    while isinstance(root, (ast.Attribute, ast.Call, ast.Subscript)):
        root = root.func if isinstance(root, ast.Call) else root.value
    return name, getattr(root, "id", None)


def test_calls_carry_objects():
    """No function takes more than ``MAX_PARAMETERS`` parameters and no call to a function or
    class of tsp_ext passes more than ``MAX_POSITIONAL`` arguments by position: long lists travel
    as keywords or objects (a spec: what a layer is; a call object: what this call has). An
    autograd function's ``apply`` takes its tensors by position: ``apply(call, *tensors)``."""
    trees = {p: ast.parse(p.read_text()) for p in sorted((ROOT / "tsp_ext").rglob("*.py"))}
    defined, classes = set(), set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            if isinstance(node, ast.ClassDef):
                classes.add(node.name)
    long_lists = []
    for path, tree in trees.items():
        name_of = path.relative_to(ROOT)
        imported = _imported_modules(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                params = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                count = len([p for p in params if p not in ("self", "cls", "ctx")])
                count += (a.vararg is not None) + (a.kwarg is not None)
                if count > MAX_PARAMETERS:
                    long_lists.append(f"{name_of}:{node.lineno} def {node.name}: {count} params")
            elif isinstance(node, ast.Call):
                name, root = _callee(node.func)
                if name == "apply" and isinstance(node.func, ast.Attribute):
                    ours = _callee(node.func.value)[0] in classes  # apply(call, *tensors)
                else:
                    ours = name in defined and root not in imported
                positional = [x for x in node.args if not isinstance(x, ast.Starred)]
                if ours and len(positional) > MAX_POSITIONAL:
                    where = f"{name_of}:{node.lineno}"
                    long_lists.append(f"{where} call {name}: {len(positional)} positional")
    assert not long_lists, long_lists
