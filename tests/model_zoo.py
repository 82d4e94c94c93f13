"""Every causal LM of the pinned transformers under ``apply_tsp``: exact, or refused with a clear
``ValueError``, at D = 1 and D = 2 (``tests/test_model_zoo.py``; the table in
``docs/apply_tsp.md#every-causal-lm-of-transformers``).

Each model type's config is ``AutoConfig.for_model(model_type)`` with the flags its released
checkpoints carry where its defaults differ (``RELEASED``), shrunk by ``hf.miniature``. Rewrite the
docs' table after a transformers upgrade with ``python tests/model_zoo.py``.
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "apply_tsp.md"
HEADER = "| model_type | class | D = 1 | D = 2 | why not |"
BEGIN, END = "<!-- zoo-table: begin -->", "<!-- zoo-table: end -->"

GRANITE = dict(
    attention_multiplier=0.5, residual_multiplier=0.3, embedding_multiplier=2.0, logits_scaling=4.0
)
# flags of released checkpoints that a type's defaults lack or set otherwise
RELEASED = {
    t: GRANITE
    for t in (
        "granite",
        "granite_swa",
        "granitemoe",
        "granitemoe_swa",
        "granitemoeshared",
        "granitemoehybrid",
    )
}
# errors of an accepted fold against the unmodified model (float64 miniatures): Hugging Face's
# loss is float32 (so are the gradients through it), Gemma's norms and the Gated DeltaNet
# kernels round to float32 too
LOGITS_TOL, LOSS_TOL, GRAD_TOL = 1e-6, 1e-6, 1e-4


def model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def zoo_config(model_type: str):
    """The config of ``model_type`` as released checkpoints set it (before shrinking)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **RELEASED.get(model_type, {}))
    for c in (config, config.get_text_config()):  # fields released configs always fill in
        heads = getattr(c, "num_attention_heads", None)
        if isinstance(heads, int) and "head_dim" in vars(c) and c.head_dim is None:
            c.head_dim = c.hidden_size // heads
        if isinstance(heads, int) and getattr(c, "num_key_value_heads", 0) is None:
            c.num_key_value_heads = heads
    return config


def zoo_worker(rank: int, world: int, types: list[str]) -> dict[str, dict]:
    """Each type's outcome at D = 1 and D = ``world``: ``{"class", "status": {D: "exact" |
    "refused" | "no miniature" | "crash"}, "why": {D: text}, "errors": {D: {what: error}},
    "layers": the miniature's decoder layers}``."""
    import warnings

    import transformers.utils.logging as hf_logging
    from transformers import AutoModelForCausalLM

    from tsp_ext import init_tsp_mesh
    from tsp_ext.hf.miniature import build_miniature, decoder_layers

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    meshes = {1: init_tsp_mesh(1), world: init_tsp_mesh(world)}
    out = {}
    for t in types:
        row = out[t] = {"class": "", "status": {}, "why": {}, "errors": {}, "layers": 0}
        try:
            config = zoo_config(t)
            row["class"] = AutoModelForCausalLM._model_mapping[type(config)].__name__
            model = build_miniature(AutoModelForCausalLM._model_mapping[type(config)], config)
        except Exception as e:  # Hugging Face cannot build this type from a config
            for D in meshes:
                row["status"][D], row["why"][D] = "no miniature", _first_line(e)
            continue
        row["layers"] = len(decoder_layers(model) or ())
        for D, mesh in meshes.items():
            row["status"][D], row["why"][D], row["errors"][D] = _fold(model, mesh)
        del model
    return out


def _fold(model, mesh) -> tuple[str, str, dict]:
    """``(status, why, errors)`` of ``apply_tsp`` on a copy of ``model``."""
    from tsp_ext import apply_tsp
    from tsp_ext.hf.self_check import FoldMismatch

    try:
        folded = apply_tsp(copy.deepcopy(model), mesh)
    except FoldMismatch as e:
        return "refused", f"a folded miniature's {e.what} differs", {}
    except ValueError as e:
        return "refused", _reason(str(e)), {}
    except Exception as e:
        return "crash", f"{type(e).__name__}: {e}", {}
    return "exact", "", _errors(model, folded, mesh)


def _errors(model, folded, mesh) -> dict[str, float]:
    """Loss, logits, the largest gradient error and the eval-mode logits of ``folded`` against
    ``model`` after one backward on a batch of its own (not the self-check's):
    ``checks.trained_errors``, its per-parameter errors folded into one."""
    from checks import trained_errors

    from tsp_ext import shard_batch

    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model).train()
    want = ref(input_ids=ids, labels=ids)
    want.loss.backward()
    batch = shard_batch({"input_ids": ids, "labels": ids}, mesh)
    if folded.tsp.config.shard_vocab:
        batch["return_logits"] = True
    got = folded.train()(**batch)
    got.loss.backward()
    errs = trained_errors(folded, ref, mesh, ids, got, want, want.loss)
    named = {n for n, p in ref.named_parameters() if p.grad is not None}
    gradients = max((errs.pop(n) for n in named), default=0.0)
    return {**{k: v for k, v in errs.items() if "." not in k}, "gradients": gradients}


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


def _reason(message: str) -> str:
    """A refusal's reason without the rank prefix and the list of supported classes."""
    message = re.sub(r"^TSP rank \d+ of \d+: ", "", message)
    message = re.split(r"; supported: |; TSP runs |\(supported: ", message)[0]
    return message.strip().rstrip(".;:")


def table_rows(outcomes: dict[str, dict], world: int) -> list[list[str]]:
    """The docs' table rows of ``zoo_worker``'s outcomes, in model-type order."""
    rows = []
    for t in sorted(outcomes):
        row = outcomes[t]
        why = row["why"][world] or row["why"][1]
        why = why.replace("|", "\\|")[:220].strip()
        rows.append([f"`{t}`", row["class"], row["status"][1], row["status"][world], why])
    return rows


def render(rows: list[list[str]]) -> str:
    lines = [HEADER, "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def doc_rows() -> list[list[str]]:
    """The table as ``docs/apply_tsp.md`` has it."""
    text = DOC.read_text()
    body = text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip().splitlines()
    return [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in body[2:]]


def main() -> None:
    """Run every type on 2 ranks and rewrite the docs' table."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tsp_ext.testing.launch import run_processes

    outcomes = run_processes(zoo_worker, 2, model_types(), timeout=1800)[0]
    text = DOC.read_text()
    table = render(table_rows(outcomes, 2))
    text = text[: text.index(BEGIN) + len(BEGIN)] + "\n" + table + "\n" + text[text.index(END) :]
    DOC.write_text(text)
    crashed = [t for t, r in outcomes.items() if "crash" in r["status"].values()]
    print(f"{len(outcomes)} model types; crashed: {crashed}")


if __name__ == "__main__":
    main()
