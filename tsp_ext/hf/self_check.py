"""``apply_tsp``'s proof that a fold is exact: fold a miniature of the model's own config on the
same mesh and compare it with the unmodified miniature, before any real weight moves.

The miniature (``hf.miniature``) has the model's class and every flag of its config, small widths
and one layer of every kind. Every rank builds the same float64 miniature (same seed) and runs it
whole as the reference; the folded copy runs on the TSP group (under PyTorch's fake process group,
whose collectives move no data, there is nothing to compare: no check). Compared, on two rows of
32 tokens (the next multiple of 2·D), with labels:

- the output of every module the two models share by name (embedding, each decoder layer, its
  attention, MLP and norms, the final norm), on this rank's tokens, in the reference's call order,
- the logits and the loss,
- the gradient of every parameter of the reference (a parameter the fold dropped has none).

Every rank reduces the errors over the group, so all raise the same ``ValueError`` (or none),
naming the first module whose output differs. The miniature and its batch come from fixed seeds,
not the ranks' random states, which the check leaves as they were. A miniature proven once is
not proven again in the same process: a reference model folded beside its policy, a reloaded
model, or another size of the same model (models that differ only in what the miniature shrinks
have the same miniature).

Tolerances are float32-level: relative 1e-5 for outputs, logits and loss, 1e-4 for gradients, or
ten times the error of the same reference run whole in float32 where that is larger (a badly
conditioned quantity). Hugging Face computes parts of a float64 model in float32 itself (its loss,
rotary tables, Gemma's norms, the Gated DeltaNet kernels), so folds agree to float32 rounding
there; every fold found wrong so far was off by 1e-3 or more.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from ..engine.parallel import comm
from ..engine.parallel.agreement import agree
from ..engine.sharding.layout import ZigzagLayout
from .miniature import build_from_miniature_config, fitted_miniature_config

VALUE_TOL, GRAD_TOL, MARGIN = 1e-5, 1e-4, 10  # relative, float32-level (the docstring's why)
ROWS = 2
_proven: set[tuple] = set()  # (class, miniature config JSON, options, check) proven exact


class FoldMismatch(ValueError):
    """A folded miniature computes a different ``what`` (a module's output, the loss, the logits
    or a gradient) than the unmodified one: relative error ``error`` above ``tolerance``."""

    def __init__(self, message: str, what: str, error: float, tolerance: float) -> None:
        super().__init__(message)
        self.what, self.error, self.tolerance = what, error, tolerance


def self_check(model: nn.Module, mesh, group: dist.ProcessGroup, config) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless a miniature of ``model``'s config
    folds exactly under ``config`` (a ``TSPConfig``) on ``mesh``."""
    how = "folded, a miniature of its config computes"
    _prove(model, mesh, group, config, check=(miniature_errors, how, " Nothing was changed."))


def self_check_inference(model: nn.Module) -> None:
    """Raise ``ValueError`` on every rank of a TSP model's group unless its inference path
    (prefill and decode steps with a ``TSPCache``: ``hf.inference``, which runs each layer as its
    family spec says rather than through the layer's own forward) gives a miniature's logits as
    the unmodified miniature does. Run at a model's first prefill (its ``TSPConfig.self_check``),
    once per miniature and process; text models (a VLM's prompts need its processor)."""
    state = model.tsp
    if state.config.self_check and state.family.vision is None:
        how = "with a KV cache (generate), a folded miniature computes"
        _prove(model, state.mesh, state.group, state.config, check=(inference_errors, how, ""))


def _prove(model: nn.Module, mesh, group: dist.ProcessGroup, config, check: tuple) -> None:
    """Run ``check = (errors function, how the message says it, what it says moved)`` on a
    miniature of ``model``'s config unless that check proved it before in this process; raise on
    every rank (``FoldMismatch``) if an error is over its tolerance."""
    if dist.get_backend(group) == "fake":  # emulation: collectives move no data, nothing to see
        return
    errors_of, how, moved = check
    D = dist.get_world_size(group)
    options = miniature_options(config, D)
    device = comm.group_device(group)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        mini, error = _miniature_config(model, D)  # the caller's RNG left as it was
        agree(error, [], group)  # every rank raises this rank's error, or none does
        key = (type(model).__qualname__, mini.to_json_string(), options, errors_of.__name__)
        if key in _proven:
            return
        errors = errors_of(type(model), mini, mesh, group=group, options=options)
    _refuse_mismatch(model, errors, how, moved)
    _proven.add(key)


def _refuse_mismatch(model: nn.Module, errors: list, how: str, moved: str) -> None:
    """Raise ``FoldMismatch`` for the first of ``errors`` (``(what, error, tolerance)``) over its
    tolerance."""
    for what, err, tol in errors:
        if not err <= tol:  # NaN included
            raise FoldMismatch(
                f"{type(model).__name__} (model_type={model.config.model_type!r}) is not "
                f"supported under TSP: {how} a different {what} than Hugging Face (relative "
                f"error {err:.3g}, tolerance {tol:.3g}); something in this model (a config flag "
                f"or a module) is not what TSP's layers compute.{moved} "
                "TSPConfig(self_check=False) skips this proof at your own risk",
                what,
                err,
                tol,
            )


def miniature_options(config, D: int):
    """The options a miniature is folded with: the engine's as given, the model-level memory
    options (layer checkpoints, offload, QLoRA) off, no self-check of its own."""
    return replace(
        config,
        tsp_size=D,
        self_check=False,
        quantize_base=None,
        checkpoint_layers=False,
        offload_checkpoints=False,
        checkpoint_every=1,
        checkpoint_device_bytes=0,
    )


def _miniature_config(model: nn.Module, D: int):
    """``(fitted_miniature_config of model's, None)``, or ``(None, why it has none)``."""
    try:
        return fitted_miniature_config(type(model), model.config, tsp_size=D), None
    except ValueError as e:
        return None, str(e)
    except Exception as e:  # a config the miniature did not foresee: refuse it, saying what broke
        return None, _unforeseen(type(model).__name__, "building", e)


def _unforeseen(name: str, doing: str, e: Exception) -> str:
    return (
        f"{name} is not supported under TSP: {doing} a miniature of its config failed with "
        f"{type(e).__name__}: {e}"
    )


@torch.inference_mode(False)
@torch.enable_grad()
def miniature_errors(
    model_class, mini, mesh, group: dist.ProcessGroup, options
) -> list[tuple[str, float, float]]:
    """``(what, relative error, tolerance)`` of ``model_class``'s miniature of config ``mini``
    (``fitted_miniature_config``) folded under ``options`` (``miniature_options``) against the
    unmodified one, the same on every rank of ``group``: each shared module's output in call
    order, then the logits, the loss and each parameter's gradient (collective)."""
    from .apply import apply_tsp  # apply_tsp calls this module
    from .batch import shard_batch
    from .full_state import full_grads

    D, p = comm.size_and_rank(group)
    device = comm.group_device(group)  # where the miniature runs
    folded = error = None
    ref = build_from_miniature_config(model_class, mini, device)
    try:
        folded = apply_tsp(copy.deepcopy(ref), mesh, config=options)
    except ValueError as e:
        error = str(e)
    except Exception as e:  # a model TSP's checks did not foresee: refuse it, saying what broke
        error = _unforeseen(model_class.__name__, "folding", e)
    agree(error, [], group)  # every rank raises this rank's error, or none does

    S = 2 * D * max(2, -(-16 // D))  # >= 32 tokens, two chunks of >= 2 tokens per rank
    ids = torch.randint(0, _vocab(ref), (ROWS, S), generator=torch.Generator().manual_seed(0))
    full = {"input_ids": ids.to(device), "labels": ids.to(device)}
    layout = ZigzagLayout(S, D)
    want, order = _run(ref, full)
    rounded, _ = _run(copy.deepcopy(ref).float(), full, order)  # float32's rounding: the bound
    batch = shard_batch(full, mesh)
    if options.shard_vocab:
        batch["return_logits"] = True
    got, _ = _run(folded, batch, order)
    grads = full_grads(folded)
    whats, rows = [], []  # rows: |folded - reference|, |reference|, |float32 - reference|
    for what in (*order, "logits", "loss"):
        r, g = want[what], got.get(what)
        local = layout.shard(r, p) if r.dim() >= 2 and r.shape[:2] == (ROWS, S) else r
        if g is None or g.shape != local.shape:
            continue  # outputs of other shapes (e.g. a sharded LM head's): not comparable
        whats.append(what if what in ("loss", "logits") else f"output of {what}")
        rows.append(_row(g, local, rounded[what], r))
    for n, param in ref.named_parameters():
        if param.grad is None:
            continue
        whats.append(f"gradient of {n}")
        g = grads.get(n)
        if g is None or g.shape != param.grad.shape:  # the fold dropped or reshaped it
            g = torch.full_like(param.grad, torch.inf)
        rows.append(_row(g, param.grad, rounded.grads[n], param.grad))
    table = torch.tensor(rows, dtype=torch.float64, device=device)
    comm.all_reduce_max(table, group)
    table = table.cpu().tolist()
    errors = []
    for what, (diff, scale, rounding) in zip(whats, table):
        floor = GRAD_TOL if what.startswith("gradient") else VALUE_TOL
        tol = max(floor, MARGIN * rounding / max(scale, 1e-30))
        errors.append((what, diff / max(scale, 1e-30), tol))
    return errors


@torch.inference_mode(False)
@torch.no_grad()
def inference_errors(
    model_class, mini, mesh, group: dist.ProcessGroup, options
) -> list[tuple[str, float, float]]:
    """``(what, relative error, tolerance)`` of the logits of ``model_class``'s miniature of
    config ``mini`` folded under ``options``, run with a ``TSPCache`` (a prefill of 2·D + 3
    tokens, then three one-token decode steps), against the unmodified miniature's logits of the
    same tokens (one forward, no cache), the same on every rank of ``group`` (collective)."""
    from .apply import apply_tsp  # apply_tsp calls this module
    from .cache import TSPCache

    D = dist.get_world_size(group)
    device = comm.group_device(group)
    ref = build_from_miniature_config(model_class, mini, device).eval()
    folded = apply_tsp(copy.deepcopy(ref), mesh, config=options).eval()
    S, steps = 2 * D + 3, 3  # a prompt that is no multiple of 2·D, and the steps after it
    ids = torch.randint(
        0, _vocab(ref), (ROWS, S + steps), generator=torch.Generator().manual_seed(0)
    )
    ids = ids.to(device)
    want = ref(input_ids=ids).logits[:, S - 1 :]
    rounded = copy.deepcopy(ref).float()(input_ids=ids).logits[:, S - 1 :]
    cache = TSPCache(folded)
    got = [folded(input_ids=ids[:, :S], cache=cache).logits[:, -1]]
    for t in range(S, S + steps):
        got.append(folded(input_ids=ids[:, t : t + 1], cache=cache).logits[:, -1])
    rows = [_row(g, want[:, i], rounded[:, i], want[:, i]) for i, g in enumerate(got)]
    table = torch.tensor(rows, dtype=torch.float64, device=device)
    comm.all_reduce_max(table, group)
    whats = ["logits after the prefill", *(f"logits of decode step {i + 1}" for i in range(steps))]
    return [
        (what, diff / max(scale, 1e-30), max(VALUE_TOL, MARGIN * rounding / max(scale, 1e-30)))
        for what, (diff, scale, rounding) in zip(whats, table.cpu().tolist())
    ]


def _row(got, want, rounded, full) -> list[float]:
    """``[max |got - want|, max |want|, max |rounded - full|]`` (``rounded``: the float32
    reference's value of the reference's ``full``)."""
    want = want.double()
    return [
        (got.double() - want).abs().max().item(),
        want.abs().max().item(),
        (rounded.double() - full.double()).abs().max().item(),
    ]


def _run(model: nn.Module, batch: dict, shared: list[str] | None = None):
    """``model(**batch)`` in train mode, its loss backpropagated. Returns the outputs (``"loss"``,
    ``"logits"``, each module's first output tensor by name; ``.grads``: each parameter's
    gradient) and the names of the modules whose output was recorded, in call order. Modules:
    those of ``shared`` (the reference's) or, if None, every module of ``model``."""
    outputs: dict[str, torch.Tensor | None] = {}
    modules = dict(model.named_modules())
    names = [n for n in (shared if shared is not None else modules) if n and n in modules]

    def record(name):
        def hook(_module, _args, out):
            if name not in outputs:
                outputs[name] = _first_tensor(out)

        return hook

    handles = [modules[n].register_forward_hook(record(n)) for n in names]
    try:
        model.train()
        out = model(**batch)
        out.loss.backward()
    finally:
        for h in handles:
            h.remove()
    recorded = [n for n, t in outputs.items() if t is not None]
    result = _Outputs({n: outputs[n].detach() for n in recorded})
    result.update(loss=out.loss.detach(), logits=out.logits.detach())
    result.grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return result, recorded


class _Outputs(dict):
    """A run's outputs by name, and its gradients (``grads``)."""

    grads: dict[str, torch.Tensor]


def _first_tensor(out) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    if isinstance(out, (tuple, list)) and out:
        return _first_tensor(out[0])
    if hasattr(out, "to_tuple"):
        return _first_tensor(out.to_tuple())
    return None


def _vocab(model: nn.Module) -> int:
    return model.config.get_text_config().vocab_size
