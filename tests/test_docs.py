"""Every fenced block of README.md and docs/*.md, as written (see README, "Docs that run").

A block is run according to its fence language and an optional directive in an HTML comment on
the line just before the fence, ``<!-- docs-test: OPTION ... -->``:

- ``python``: executed on ``ranks=N`` kept gloo ranks (default 1: this process), in a directory of
  its own; the names it uses without defining them come from ``given=a,b`` (tests/docs_given.py:
  a tiny Llama, a short batch, ...). ``file=NAME`` saves it as NAME for the doc's shell blocks.
- ``bash``: run with bash (``set -e``) in a directory of its own that links the checkout's
  ``recipes/``, ``benchmarks/`` and ``docs/``, the venv's ``bin`` first on ``PATH`` (as after
  ``source .venv/bin/activate``); the blocks run side by side.
- ``check=WHY`` (``gpu``, ``minutes``, ``demo``, ``your-files``): not run. Python: it compiles,
  its imports import, every other name it reads is defined in it or given. Shell: ``bash -n``,
  and each command names a make target, script or module that exists and only flags that its
  ``--help`` lists.
- ``json``: parses (``check=excerpt``: an abridged shape, not parsed). Untagged fences are
  output.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import functools
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from unittest import mock

import pytest
from docs_given import GIVEN, namespace

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent
LINKED = ("recipes", "benchmarks", "docs")
FENCE = re.compile(
    r"^(?:<!-- docs-test: (?P<opts>.*?) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)^```", re.M | re.S
)
CHECK_REASONS = {"gpu", "minutes", "demo", "your-files", "excerpt"}


@dataclass
class Block:
    doc: str
    line: int
    lang: str
    code: str
    opts: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def given(self) -> list[str]:
        return [g for g in self.opts.get("given", "").split(",") if g]


def blocks() -> list[Block]:
    found = []
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            opts = dict(o.split("=", 1) if "=" in o else (o, "") for o in (m["opts"] or "").split())
            line = text[: m.start("code")].count("\n")
            found.append(Block(str(path.relative_to(ROOT)), line, m["lang"], m["code"], opts))
    return found


BLOCKS = [b for b in blocks() if b.lang]


def test_directives_are_known():
    """A misspelt directive would silently run or skip a block."""
    for b in BLOCKS:
        assert set(b.opts) <= {"ranks", "given", "file", "check"}, b.name
        assert b.opts.get("check", "x") in CHECK_REASONS | {"x"}, b.name
        assert set(b.given) <= set(GIVEN), (b.name, set(b.given) - set(GIVEN))
        assert b.lang in {"python", "bash", "json"}, b.name


# the blocks that run: not checked-only, not a file= script (its shell block runs it)
RUN = [b for b in BLOCKS if not {"check", "file"} & set(b.opts) and b.lang in ("python", "bash")]


# ---- running ----------------------------------------------------------------------------------


def workdir(base: Path, block: Block) -> Path:
    """A directory of the block's own with the checkout's folders linked in and the doc's
    ``file=`` blocks written."""
    path = base / re.sub(r"\W", "_", block.name)
    path.mkdir(parents=True)
    for name in LINKED:
        (path / name).symlink_to(ROOT / name)
    for other in BLOCKS:
        if other.doc == block.doc and "file" in other.opts:
            (path / other.opts["file"]).write_text(other.code)
    return path


def python_block(rank: int, world: int, code: str, given: list[str], where: str, name: str):
    """Run ``code`` in ``where`` with the given names (on a kept rank, or in this process)."""
    here = os.getcwd()
    os.chdir(where)
    try:
        exec(compile(code, name, "exec"), namespace(given, rank, world, where))
    finally:
        os.chdir(here)


_launcher = threading.Lock()


def bash_block(block: Block, where: Path) -> subprocess.CompletedProcess:
    """Blocks that start a launcher run one at a time: as written, each takes its default
    rendezvous port (29500)."""
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "VIRTUAL_ENV": str(BIN.parent)}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    launches = re.search(r"\b(accelerate launch|torchrun)\b", block.code)
    with _launcher if launches else contextlib.nullcontext():
        return subprocess.run(
            ["bash", "-c", "set -e\n" + block.code],
            cwd=where, env=env, capture_output=True, text=True, timeout=400,
        )  # fmt: skip


@functools.cache
def outcomes(workers, base: str) -> dict[str, object]:
    """Every run block's outcome by name: shell blocks in threads, side by side with the Python
    blocks on the kept ranks; None for a Python block that ran, or its error."""
    base = Path(base)
    done: dict[str, object] = {}
    with ThreadPoolExecutor(4) as pool:
        shells = {
            b.name: pool.submit(bash_block, b, workdir(base, b)) for b in RUN if b.lang == "bash"
        }
        checks = {b.name: pool.submit(check_shell, b) for b in BLOCKS if b.lang == "bash"}
        for b in RUN:
            if b.lang != "python":
                continue
            where, world = str(workdir(base, b)), int(b.opts.get("ranks", 1))
            try:
                if world == 1:
                    python_block(0, 1, b.code, b.given, where, b.name)
                else:
                    workers.run(python_block, world, b.code, b.given, where, b.name, timeout=240)
                done[b.name] = None
            except Exception as e:  # reported by the block's own test
                done[b.name] = e
        for name, f in [*shells.items(), *((f"check {n}", f) for n, f in checks.items())]:
            try:
                done[name] = f.result()
            except Exception as e:  # reported by the block's own test
                done[name] = e
    return done


@pytest.mark.parametrize("block", RUN, ids=lambda b: b.name)
def test_block_runs_as_written(workers, tmp, block):
    got = outcomes(workers, tmp)[block.name]
    if block.lang == "bash":
        assert got.returncode == 0, f"{block.name}:\n{got.stdout[-2000:]}\n{got.stderr[-3000:]}"
    else:
        assert got is None, f"{block.name}: {got!r}"


def ran(workers, tmp: str, doc: str, command: str) -> tuple[Path, subprocess.CompletedProcess]:
    """The run of ``doc``'s shell block that contains ``command``: (its directory, outcome)."""
    [b] = [b for b in RUN if b.doc == doc and b.lang == "bash" and command in b.code]
    got = outcomes(workers, tmp)[b.name]
    assert got.returncode == 0, got.stderr[-3000:]
    return Path(tmp) / re.sub(r"\W", "_", b.name), got


def test_recipe_without_a_launcher_is_one_process(workers, tmp):
    """docs/recipes.md: a plain ``python recipes/finetune_long_llama.py`` (no accelerate launch,
    no torchrun) is one process, TSP = 1; eval loss and greedy sample before and after."""
    where, res = ran(workers, tmp, "docs/recipes.md", "python recipes/finetune_long_llama.py")
    assert "dp=1 x tsp=1" in res.stdout
    assert "before fine-tuning" in res.stdout and "  after:  " in res.stdout
    rows = [json.loads(line) for line in open(where / "outputs/one/metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert (where / "outputs/one/final/model.safetensors").is_file()
    memory = json.loads((where / "outputs/one/memory.json").read_text())
    assert memory["processes"] == memory["tsp_size"] == 1
    assert memory["model_state_bytes_per_rank"] == 16 * memory["parameters"]  # fp32 + AdamW


@pytest.mark.parametrize("script", ["train_tsp.py", "train_tsp_zero2.py"])
def test_trainer_scripts_train_and_export(workers, tmp, script):
    """docs/trainer.md's scripts (DDP; DeepSpeed ZeRO-2 with a "tsp" block) under accelerate
    launch: 10 logged steps from ~ln(512), then the export loads in one process."""
    from transformers import AutoModelForCausalLM

    where, res = ran(workers, tmp, "docs/trainer.md", f" {script}")
    losses = [float(x) for x in re.findall(r"'loss': '([0-9.]+)'", res.stdout + res.stderr)]
    assert len(losses) >= 10 and min(losses) > 5  # ~ln(512): random tokens
    out = "outputs/trainer" if script == "train_tsp.py" else "outputs/trainer_zero2"
    assert AutoModelForCausalLM.from_pretrained(where / out / "hf").config.vocab_size == 512


# ---- checking what is not run -----------------------------------------------------------------


def free_names(code: str) -> set[str]:
    """Names read but never bound in ``code`` (module level and functions alike)."""
    tree = ast.parse(code)
    bound, read = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return read - bound


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=lambda b: b.name)
def test_python_block_names_resolve(block):
    """Every Python block (run or not) compiles, its imports import, and each name it reads is
    bound in it or given by its directive."""
    tree = ast.parse(block.code, block.name)
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    exec(compile(ast.Module(imports, []), block.name, "exec"), {})
    missing = free_names(block.code) - {g.split("=")[0] for g in block.given}
    assert not missing, f"{block.name} reads {sorted(missing)}: define them or add given="


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "json"], ids=lambda b: b.name)
def test_json_block_parses(block):
    if block.opts.get("check") != "excerpt":
        json.loads(block.code)


_help_lock = threading.Lock()


@functools.cache
def help_text(kind: str, target: str, *sub: str) -> str:
    """What ``--help`` prints for a script (``kind="path"``), a module run with ``-m``
    (``"module"``) or a console script (``"entry"``), run in this process (its imports are this
    process's already): one call at a time, since ``sys.argv`` and ``sys.stdout`` are shared."""
    out, code = io.StringIO(), 0
    with _help_lock, mock.patch.object(sys, "argv", [target, *sub, "--help"]):
        with contextlib.redirect_stdout(out):
            try:
                if kind == "path":  # as `python script.py`: its folder first on the path
                    sys.path.insert(0, os.path.dirname(target))
                    runpy.run_path(target, run_name="__main__")
                elif kind == "module":  # as `python -m` from the checkout
                    if str(ROOT) not in sys.path:
                        sys.path.insert(0, str(ROOT))
                    with warnings.catch_warnings():  # imported already by other tests: fine
                        warnings.filterwarnings(
                            "ignore", "'.*' found in sys.modules", RuntimeWarning
                        )
                        runpy.run_module(target, run_name="__main__", alter_sys=True)
                else:
                    [entry] = entry_points(group="console_scripts", name=target)
                    entry.load()()
            except SystemExit as stop:  # argparse's exit after the help
                code = stop.code
    assert code in (0, None), f"{target} --help exited with {code}"
    return out.getvalue()


def commands(code: str) -> list[list[str]]:
    """The block's simple commands as argument lists: continuations joined, comments dropped,
    split at ``&&``, ``;``, ``|`` and redirections, leading ``VAR=value`` removed."""
    out, pending = [], ""
    for line in code.replace("\\\n", " ").splitlines():
        pending += line + "\n"
        try:  # a quoted argument may span lines: read on until it closes
            tokens = list(lexer(pending))
        except ValueError:
            continue
        pending, cmd = "", []
        for token in [*tokens, ";"]:
            if set(token) <= set(";&|><"):
                if cmd and cmd[0] != "<redirect>":
                    out.append(cmd)
                cmd = ["<redirect>"] if ">" in token or "<" in token else []
            else:
                cmd.append(token)
    for cmd in out:
        while cmd and re.fullmatch(r"[A-Z_]+=.*", cmd[0]):
            cmd.pop(0)
    return [c for c in out if c]


def lexer(text: str) -> shlex.shlex:
    lex = shlex.shlex(text, posix=True, punctuation_chars=";&|><")
    lex.whitespace_split, lex.commenters = True, "#"
    return lex


def program_of(cmd: list[str]) -> tuple[tuple[str, ...], list[str]]:
    """(``help_text``'s arguments for the program that parses the flags, those arguments)."""
    exe, rest = os.path.basename(cmd[0]), cmd[1:]
    if exe in ("accelerate", "torchrun"):
        script = next(i for i, a in enumerate(rest) if a.endswith(".py"))
        return program_of(["python", *rest[script:]])
    if exe == "python":
        if rest[0] == "-c":
            compile(rest[1], "python -c", "exec")
            return (), []
        if rest[0] == "-m":
            return ("module", rest[1]), rest[2:]
        if rest[0] in {b.opts.get("file") for b in BLOCKS}:  # written by the doc's own block
            return (), []
        assert (ROOT / rest[0]).is_file(), f"no such script {rest[0]}"
        return ("path", str(ROOT / rest[0])), rest[1:]
    if exe == "tsp-plan":
        return ("entry", "tsp-plan"), rest
    return (), []


def check_shell(block: Block) -> str:
    """Problems of a shell block without running it ("" when none)."""
    syntax = subprocess.run(["bash", "-n", "-c", block.code], capture_output=True, text=True)
    if syntax.returncode:
        return f"{block.name}: {syntax.stderr}"
    problems = []
    written = set(re.findall(r">\s*([\w./-]+)", block.code))
    for cmd in commands(block.code):
        problems += missing_inputs(cmd, written)
        try:
            problems += check_command(cmd)
        except (AssertionError, SyntaxError, StopIteration, IndexError) as e:
            problems.append(f"{' '.join(cmd)}: {e!r}")
    return "\n".join(f"{block.name}: {p}" for p in problems)


INPUT_FLAGS = ("--checkpoint", "--prompt-file", "--resume-from", "--calibrate")


@functools.cache
def produced() -> set[str]:
    """The directories the docs' commands and the Makefile's targets write."""
    dirs = set(re.findall(r"^\w+_DIR \?= (\S+)", (ROOT / "Makefile").read_text(), re.M))
    for b in BLOCKS:
        if b.lang == "bash":
            dirs |= {c[i + 1] for c in commands(b.code) for i, a in enumerate(c[:-1])
                     if a == "--output-dir"}  # fmt: skip
    return dirs


def missing_inputs(cmd: list[str], written: set[str]) -> list[str]:
    """Files a command reads that neither ship, nor are written by its block, nor lie in a
    directory another documented command writes."""
    problems = []
    for flag, value in zip(cmd, cmd[1:]):
        if flag not in INPUT_FLAGS or value == "auto" or value in written:
            continue
        made = any(value == d or value.startswith(d + "/") for d in produced())
        if not made and not (ROOT / value).exists():
            problems.append(f"{flag} {value}: no documented command writes it")
    return problems


def check_command(cmd: list[str]) -> list[str]:
    exe = os.path.basename(cmd[0])
    if exe == "make":
        dry = subprocess.run(["make", "-n", "-C", str(ROOT), *cmd[1:]], capture_output=True)
        return [f"make {' '.join(cmd[1:])}: no such target"] if dry.returncode else []
    problems = []
    if exe in ("accelerate", "torchrun"):
        launcher = ("entry", exe, "launch") if exe == "accelerate" else ("entry", exe)
        end = next(i for i, a in enumerate(cmd) if a.endswith(".py"))
        problems += unknown_flags(cmd[1:end], help_text(*launcher), " ".join(launcher[1:]))
    program, args = program_of(cmd)
    if program:
        problems += unknown_flags(args, help_text(*program), program[1])
    return problems


def unknown_flags(args: list[str], usage: str, program: str) -> list[str]:
    flags = {a.split("=")[0] for a in args if a.startswith("--") and len(a) > 2}
    return [f"{program} has no {f}" for f in sorted(flags) if not re.search(rf"{f}\b", usage)]


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "bash"], ids=lambda b: b.name)
def test_shell_block_names_exist(workers, tmp, block):
    """Every shell block (run or not) parses, and names only existing make targets, scripts,
    modules and flags."""
    assert outcomes(workers, tmp)[f"check {block.name}"] == ""


def test_shell_checks_catch_what_broke_before():
    """The check of blocks that are not run catches a missing script, flag, make target or
    input file (docs/inference.md once read outputs/finetune/final and play.md)."""
    block = Block(
        "x.md",
        1,
        "bash",
        """make no-such-target
python recipes/generate.py --checkpoint outputs/finetune/final --no-such-flag 1
python recipes/generate.py --prompt-file play.md
python recipes/no_such_script.py
""",
    )
    problems = check_shell(block)
    assert "make no-such-target: no such target" in problems
    assert "has no --no-such-flag" in problems
    assert "--checkpoint outputs/finetune/final: no documented command writes it" in problems
    assert "--prompt-file play.md: no documented command writes it" in problems
    assert "no such script recipes/no_such_script.py" in problems
    assert check_shell(Block("x.md", 1, "bash", "python recipes/generate.py --prompt-file p\n"))


def test_names_check_catches_an_unimported_name():
    """docs/checkpoints.md once used torch without importing it."""
    assert free_names("model = load(dtype=torch.bfloat16)") == {"load", "torch"}
