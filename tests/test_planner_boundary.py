"""The planner imports and runs with torch, transformers, deepspeed and accelerate absent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import importlib.abc
import json
import sys

HIDDEN = ("torch", "transformers", "deepspeed", "accelerate")


class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden)", name=name)
        return None


sys.meta_path.insert(0, Hide())

import tsp_ext.plan
import tsp_ext.planner
import tsp_ext.planner.cli
from tsp_ext.planner import PRESETS, Cluster, Workload, plan

assert tsp_ext.plan.plan is plan
result = plan(PRESETS["paper-7b"], Workload(seq_len=131072, recompute="full"), Cluster())
assert result.recommended is not None
argv = ["--model", "paper-7b", "--seq-len", "131072", "--recompute", "full", "--json"]
assert tsp_ext.planner.cli.main(argv) == 0
loaded = sorted(m for m in sys.modules if m.split(".")[0] in HIDDEN + ("matplotlib",))
print(json.dumps({"file": tsp_ext.planner.__file__, "loaded": loaded}))
"""


def test_planner_runs_without_torch():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    *cli_lines, last_line = proc.stdout.splitlines()
    assert json.loads("\n".join(cli_lines))["recommended"] is not None  # the CLI's --json
    last = json.loads(last_line)
    assert Path(last["file"]).resolve().is_relative_to(ROOT / "tsp_ext" / "planner")
    assert last["loaded"] == []  # nothing hidden was needed, and the plot's matplotlib stays lazy
