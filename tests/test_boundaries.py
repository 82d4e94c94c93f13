"""The package's layers import only what they are allowed to (checked in fresh interpreters)."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import tsp_ext.engine


def imported_after(statement: str) -> set[str]:
    """Top-level package names in ``sys.modules`` after running ``statement`` in a new Python."""
    report = "import sys\nprint(' '.join({m.split('.')[0] for m in sys.modules}))"
    code = f"{statement}\n{report}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def _engine_modules() -> list[str]:
    return [m.name for m in pkgutil.walk_packages(tsp_ext.engine.__path__, "tsp_ext.engine.")]


def test_engine_imports_torch_only():
    names = _engine_modules()
    assert {
        f"tsp_ext.engine.{n}" for n in ("attention", "feed_forward", "vocab", "parallel")
    } <= set(names)
    loaded = imported_after("\n".join(f"import {n}" for n in names))
    assert "torch" in loaded
    assert not loaded & {"transformers", "deepspeed", "accelerate", "datasets", "safetensors"}


def _engine_imports(module: str) -> set[str]:
    """Modules ``module`` imports (its own source; relative imports resolved)."""
    path = Path(tsp_ext.engine.__file__).parent.joinpath(*module.split(".")[2:])
    is_package = path.is_dir()
    path = path / "__init__.py" if is_package else path.with_suffix(".py")
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found |= {target} | {f"{target}.{a.name}" for a in node.names}
    return found


@pytest.mark.parametrize("package", ["kernels", "sharding.layout", "sharding.partition"])
def test_kernels_and_layouts_never_communicate(package):
    """What engine/__init__.py says: these modules import neither ``torch.distributed`` nor the
    engine's communication (``engine.parallel``), directly or through another engine module."""
    modules = set(_engine_modules())
    todo = [n for n in modules if n.startswith(f"tsp_ext.engine.{package}")]
    assert todo
    seen: set[str] = set()
    while todo:
        module = todo.pop()
        seen.add(module)
        imports = _engine_imports(module)
        talks = [
            i for i in imports if i.startswith(("torch.distributed", "tsp_ext.engine.parallel"))
        ]
        assert not talks, f"{module} imports {talks}"
        todo += [i for i in imports & modules if i not in seen]


@pytest.mark.parametrize(
    "statement, forbidden",
    [
        ("from tsp_ext import apply_tsp, shard_batch", {"deepspeed", "accelerate", "datasets"}),
        ("import tsp_ext.fsdp", {"deepspeed", "accelerate", "datasets"}),
        ("import tsp_ext.checkpoint.training", {"deepspeed", "accelerate", "datasets"}),
    ],
)
def test_layers_do_not_pull_optional_integrations(statement, forbidden):
    assert not imported_after(statement) & forbidden


def test_subpackages_are_attributes_after_import_tsp_ext():
    """``import tsp_ext`` then ``tsp_ext.checkpoint.save`` (docs/deepspeed.md), in a fresh
    interpreter where nothing imported the subpackage first."""
    code = "import tsp_ext\n"
    code += "print(tsp_ext.checkpoint.save.__module__, tsp_ext.deepspeed.initialize.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["tsp_ext.checkpoint.training", "initialize"]
    assert {"checkpoint", "deepspeed", "fsdp", "planner"} <= set(dir(tsp_ext))


def test_inference_uses_the_modules_public_api():
    """hf/inference.py runs prefill and decode through the modules' public ``prefill`` /
    ``decode``: it imports no private name and reaches into no private attribute."""
    import ast
    from pathlib import Path

    import tsp_ext.hf.inference as inference

    tree = ast.parse(Path(inference.__file__).read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
    assert imported and not [n for n in imported if n.startswith("_")], imported
    private = [
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
    ]
    assert not private, private


def test_llama_structure_is_named_only_in_the_family_table():
    """apply, inference, FSDP2 and loading find a model's parts through ``hf.families``: none of
    them names a Llama attribute (``model.layers``, ``self_attn``, ``q_proj``, ...) itself."""
    import ast
    from pathlib import Path

    from tsp_ext.hf.families import LLAMA

    names = {
        LLAMA.attention, LLAMA.embedding, LLAMA.rotary, LLAMA.attention_norm, LLAMA.mlp_norm,
        *LLAMA.attention_projections, *LLAMA.mlp_projections,
    }  # fmt: skip
    root = Path(tsp_ext.__file__).parent
    for path in ("hf/apply.py", "hf/inference.py", "dp/fsdp.py", "checkpoint/loading.py"):
        tree = ast.parse((root / path).read_text())
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
        }
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute):
                assert n.attr not in names, (path, n.lineno, n.attr)
                chain = isinstance(n.value, ast.Attribute) and n.value.attr == LLAMA.base
                assert not (chain and n.attr == LLAMA.layers), (path, n.lineno)
            if isinstance(n, ast.Constant) and id(n) not in docstrings:
                assert not (isinstance(n.value, str) and n.value in names), (path, n.lineno)


# each layer and the layers it may import (lazy imports inside functions included); the core is
# the top-level modules below
CORE = {"mesh", "config", "storage", "writer"}
LAYERS = {
    "engine": set(),
    "core": {"engine"},
    "hf": {"engine", "core"},
    "dp": {"engine", "core", "hf"},
    "checkpoint": {"engine", "core", "hf", "dp"},
    "integrations": {"engine", "core", "hf", "dp", "checkpoint"},
    "planner": {"engine", "hf"},  # torch-free modules only: tests/test_planner_boundary.py
    "testing": set(),
}


def _layer(module: str) -> str | None:
    """The layer of ``tsp_ext.<name>...``; None for the top-level facades (``__init__``,
    ``deepspeed``, ``fsdp``, ``plan``, ``memory``), which may import any layer."""
    name = module.split(".")[1] if module.count(".") else ""
    return "core" if name in CORE else name if name in LAYERS else None


def test_layers_import_only_the_layers_below():
    root = Path(tsp_ext.__file__).parent
    wrong = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = module.split(".") if parts[-1] == "__init__" else module.split(".")[:-1]
        layer = _layer(module)
        if layer is None:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - node.level + 1]
                targets = [".".join(base + ([node.module] if node.module else []))]
                if not node.module:
                    targets = [f"{targets[0]}.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                targets = [node.module or ""]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                if target.startswith("tsp_ext."):
                    other = _layer(target)
                    if other != layer and other not in LAYERS[layer]:
                        wrong.append(f"{module} ({layer}) imports {target} ({other})")
    assert not wrong, wrong
