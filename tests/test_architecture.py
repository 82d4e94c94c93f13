"""The tree's shape, as docs/architecture.md describes it: each place it names to add a model
family, attention backend, data-parallel engine or benchmark layout exists, with its guard test;
every package's docstring lists its modules; the code docstrings name exists; no module or
function outgrows what one reader holds."""

from __future__ import annotations

import ast
import functools
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
                names |= {  # dataclass fields
                    f"{node.name}.{n.target.id}"
                    for n in node.body
                    if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                }
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def test_where_to_add_names_places_that_exist():
    rows = _where_to_add_rows()
    assert {what.lower() for what, _ in rows} >= {
        "a model family of an existing kind",
        "a kind of token mixer",
        "a kind of channel mixer (or expert form)",
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


def _sources() -> list[Path]:
    """Every Python file of the library, the recipes and the benchmarks."""
    return sorted(p for d in ("tsp_ext", "recipes", "benchmarks") for p in (ROOT / d).rglob("*.py"))


def test_modules_and_functions_stay_small():
    too_long = []
    for path in _sources():
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


# what a docstring's dotted reference may start with: tsp_ext, its packages and top-level modules,
# the engine's sub-packages (and, below, the modules of the docstring's own package and parents)
REFERENCE_HEADS = {
    "tsp_ext",
    "engine",
    "hf",
    "dp",
    "checkpoint",
    "integrations",
    "planner",
    "testing",
    "mesh",
    "config",
    "memory",
    "sharding",
    "parallel",
    "kernels",
    "attention",
    "linear_attention",
    "feed_forward",
    "adapters",
}
FILE_SUFFIXES = {"json", "jsonl", "md", "py", "safetensors", "bin", "pt", "gguf", "yaml", "txt"}


def _module_file(folder: Path, name: str) -> Path | None:
    """``folder/name``'s source: the package's ``__init__.py`` or the module's file."""
    for path in (folder / name / "__init__.py", folder / f"{name}.py"):
        if path.exists():
            return path
    return None


@functools.cache
def _alias_target(path: Path) -> Path:
    """The module a ``sys.modules[__name__] = other`` alias module stands for, else ``path``."""
    tree = ast.parse(path.read_text())
    imported = {
        a.asname or a.name: (node.module or "", node.level)
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        for a in node.names
    }
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Subscript)
            and ast.unparse(node.targets[0].value) == "sys.modules"
            and isinstance(node.value, ast.Name)
            and node.value.id in imported
        ):
            module, level = imported[node.value.id]
            folder = path.parents[level - 1].joinpath(*module.split(".") if module else [])
            return _module_file(folder, node.value.id) or path
    return path


@functools.cache
def _exported_names(path: Path) -> set[str]:
    """What ``path`` defines (``_defined_names``) or re-exports (``import x as x``, ``__all__``),
    plus for a package what its ``__init__`` imports or exports lazily (its ``_EXPORTS`` keys)."""
    names = _defined_names(path)
    package = path.name == "__init__.py"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names if package or a.asname == a.name}
        elif isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "__all__":
            names |= {
                e.value for e in getattr(node.value, "elts", ()) if isinstance(e, ast.Constant)
            }
        elif package and isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            if any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
                names |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    return names


def _resolves(parts: list[str], folder: Path) -> bool:
    """``a.b.c`` from ``folder``: modules as deep as they go, then a name the last one defines,
    a ``Class.method`` of it, or a field / method of one of its classes (``options.mlp_tile``)."""
    module, i = None, 0
    while i < len(parts) and folder is not None:
        found = _module_file(folder, parts[i])
        if found is None:
            break
        module, i = _alias_target(found), i + 1
        folder = module.parent if module.name == "__init__.py" else None
    if module is None:
        return False
    rest = ".".join(parts[i:])
    names = _exported_names(module)
    return not rest or rest in names or any(n.endswith(f".{rest}") for n in names)


def _reference_bases(path: Path) -> list[Path]:
    """Where a docstring's references in ``path`` resolve from: its own package first, then each
    package above it, then ``tsp_ext/`` and the repository root."""
    own = [path.parent, *(p for p in path.parent.parents if ROOT / "tsp_ext" in (p, *p.parents))]
    return list(dict.fromkeys([*own, ROOT / "tsp_ext", ROOT]))


@functools.cache
def _engine_modules() -> dict[str, Path]:
    """The engine's modules whose name no other tsp_ext module has, each with its folder: a
    docstring may name them from anywhere (``weight_ring.broadcast_stream``)."""
    folders: dict[str, list[Path]] = {}
    for p in (ROOT / "tsp_ext").rglob("*.py"):
        if p.stem != "__init__":
            folders.setdefault(p.stem, []).append(p.parent)
    engine = ROOT / "tsp_ext" / "engine"
    return {
        name: found[0]
        for name, found in folders.items()
        if len(found) == 1 and engine in (found[0], *found[0].parents)
    }


def _docstrings(tree: ast.Module):
    """``(line, docstring, argument names)`` of the module and every class and function in it:
    ``engine.step`` in the docstring of a function taking ``engine`` is that argument's."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if doc := ast.get_docstring(node):
                args = getattr(node, "args", None)
                names = [*args.posonlyargs, *args.args, *args.kwonlyargs] if args else []
                yield getattr(node, "lineno", 1), doc, {a.arg for a in names}


def _stale_references(path: Path, source: str) -> list[str]:
    """The ````double-backticked```` references in ``path``'s docstrings that name no code: dotted
    names starting with a tsp_ext package or module (or a module of the docstring's own package,
    of those above it, or a uniquely named engine module), and ``.py`` paths."""
    bases = _reference_bases(path)
    unique = _engine_modules()
    heads = (
        REFERENCE_HEADS
        | unique.keys()
        | {
            p.stem if p.suffix else p.name
            for base in bases[:-2]
            for p in base.iterdir()
            if p.suffix == ".py" or (p / "__init__.py").exists()
        }
    )
    stale = []
    for line, doc, arguments in _docstrings(ast.parse(source)):
        for span in re.findall(r"``([^`]+)``", doc):
            file = span.split("::")[0]
            if re.fullmatch(r"[\w./-]+\.py", file):
                if not any((base / file).exists() for base in bases):
                    stale.append(f"{path.relative_to(ROOT)}:{line} ``{span}``")
                continue
            for ref in re.findall(r"(?<![\w.])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+", span):
                parts = ref.split(".")
                if parts[0] not in heads or parts[0] in arguments or parts[-1] in FILE_SUFFIXES:
                    continue
                where = [*bases, unique[parts[0]]] if parts[0] in unique else bases
                if not any(_resolves(parts, base) for base in where):
                    stale.append(f"{path.relative_to(ROOT)}:{line} ``{span}``")
    return stale


def test_docstring_references_exist():
    stale = [ref for path in _sources() for ref in _stale_references(path, path.read_text())]
    assert not stale, stale


@pytest.mark.parametrize(
    "folder, doc, resolves",
    [
        ("engine", "``engine.attention.schedule`` ``attention.heads.AttentionSpec``", True),
        ("engine/attention", "``head_groups.HeadGroup`` ``sharding.documents``", True),
        ("engine", "``options.EngineOptions.mlp_tile`` (``options.mlp_tile``)", True),
        ("hf", "``tsp_ext.apply_tsp`` ``tsp_ext.fsdp.clip_grad_norm_`` ``hf.moe``", True),
        ("engine", "``engine/attention/window.py``, ``tests/test_architecture.py``", True),
        ("engine/kernels", "``engine.qk_rms.qk_rms(...)``", False),
        ("engine/attention", "``adapters.AttentionAdapters``", False),
        ("engine", "``engine/window.py``", False),
        ("hf", "``weight_ring.broadcast_stream`` ``lse.merge_partials``", True),
        ("engine/kernels", "``qk_rms.qk_rms`` ``weight_ring.no_such_name``", False),
        ("hf", "``hf.moe.no_such_name``", False),
        ("hf", "``families.expert_intermediate_size`` (re-exported)", True),
    ],
)
def test_docstring_reference_check_tells_moved_names(folder, doc, resolves):
    path = ROOT / "tsp_ext" / folder / "probe.py"
    assert (not _stale_references(path, f'"""{doc}"""\n')) == resolves


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


# forwards whose parameters Hugging Face reads by name (``generate`` passes only the inputs a
# model's ``forward`` names): their signature is Hugging Face's, not ours to shorten
SIGNATURES_HF_READS = {"tsp_vision_forward"}


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
                if count > MAX_PARAMETERS and node.name not in SIGNATURES_HF_READS:
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
