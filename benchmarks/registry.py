"""The benchmark layouts, one ``Layout`` entry each: everything else derives from this table.

A layout is one way of parallelising the same training step (the model, batch and loss of
``harness``) with a real library; its builder lives in ``layouts`` (training) or ``dpo_layouts``
(preference training, DPO). Adding one is a builder there and an entry in ``REGISTRY``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from . import dpo_layouts, layouts
from .layouts import Prepared


@dataclass(frozen=True)
class Layout:
    """One benchmark layout.

    ``about``: its library and what a rank holds of the weights and of the tokens;
    ``build(model, ids, world, device)`` parallelises the full model and batch on this rank;
    ``split(devices)``: its (tp, sp) sizes (TSP folds both onto one axis: (D, D)), raising
    ``ValueError`` for a device count it cannot run; ``process_wide``: it installs its attention
    in transformers' registry for the whole process (DeepSpeed's Ulysses replaces "sdpa"), so it
    always gets processes of its own; ``in_sweep``: ``benchmarks.run`` runs it unless told which;
    ``preference``: a DPO step (``dpo_layouts``), not the language-model loss.
    """

    name: str
    about: str
    build: Callable[..., Prepared]
    split: Callable[[int], tuple[int, int]]
    process_wide: bool = False
    in_sweep: bool = True
    preference: bool = False

    def ranks(self, devices: int) -> int:
        """Processes a run on ``devices`` devices takes: one for a single-process layout."""
        return 1 if self.split(devices) == (1, 1) else devices


def _one(devices: int) -> tuple[int, int]:
    return 1, 1


def _folded(devices: int) -> tuple[int, int]:
    return devices, devices


def _tensor(devices: int) -> tuple[int, int]:
    return devices, 1


def _sequence(devices: int) -> tuple[int, int]:
    return 1, devices


def _tsp(
    build: Callable[..., Prepared] = layouts.build_tsp,
    *,
    lora: bool = False,
    long_context: bool = False,
    **options,
) -> Callable[..., Prepared]:
    """``build`` (a TSP builder) with these ``TSPConfig`` options; ``long_context`` adds
    ``layouts.long_context``'s, ``lora`` puts the ``layouts.LORA`` adapter on the model first."""

    def builder(model, ids, world, device) -> Prepared:
        extra = layouts.long_context(model) if long_context else {}
        if lora:
            model = layouts.with_lora(model)
        return build(model, ids, world, device, **extra, **options)

    return builder


_LONGEST = dict(long_context=True, offload_checkpoints=True, overlap=False)
TSP_LONG = dict(_LONGEST, head_bucket=1)  # ``tsp_long``'s options (``dpo_tsp_long``: _LONGEST)

REGISTRY: dict[str, Layout] = {
    entry.name: entry
    for entry in (
        Layout("single", "transformers; weights all, tokens all", layouts.build_single, _one),
        Layout("tsp", "tsp_ext.apply_tsp; weights 1/D, tokens 1/D (zigzag)", _tsp(), _folded),
        Layout("tsp_no_overlap", "tsp, TSPConfig(overlap=False)", _tsp(overlap=False), _folded),
        Layout(
            "tsp_keep_mlp",
            "tsp, TSPConfig(recompute_mlp=False)",
            _tsp(recompute_mlp=False),
            _folded,
        ),
        Layout(
            "tsp_layers",
            "tsp, TSPConfig(checkpoint_layers=True, mlp_tile=h)",
            _tsp(long_context=True),
            _folded,
            in_sweep=False,
        ),
        Layout(
            "tsp_offload",
            "tsp_layers, offload_checkpoints=True",
            _tsp(long_context=True, offload_checkpoints=True),
            _folded,
            in_sweep=False,
        ),
        Layout(
            "tsp_long",
            "tsp_offload, overlap=False, head_bucket=1 (one KV head's K/V and gradients at a "
            "time): the longest context",
            _tsp(**TSP_LONG),
            _folded,
        ),
        Layout(
            "tsp_intervals",
            "tsp_long, checkpoint_every=2 (one input per two layers kept; host bytes / 2)",
            _tsp(**TSP_LONG, checkpoint_every=2),
            _folded,
            in_sweep=False,
        ),
        Layout(
            "tsp_lora",
            "tsp on a PEFT LoRA model (layouts.LORA: r = 16 on all seven projections, base frozen)",
            _tsp(lora=True),
            _folded,
            in_sweep=False,
        ),
        Layout(
            "tsp_qlora",
            "tsp_lora, the base NF4-packed (TSPConfig(quantize_base='nf4'))",
            _tsp(lora=True, quantize_base="nf4"),
            _folded,
            in_sweep=False,
        ),
        Layout(
            "tp",
            "torch parallelize_module with the model's HF tp plan; weights 1/D, tokens all",
            layouts.build_tp,
            _tensor,
        ),
        Layout(
            "tp_sp",
            "torch TP + SequenceParallel norms (Megatron TP+SP); weights 1/D, tokens 1/D between"
            " blocks",
            layouts.build_tp_sp,
            _tensor,
        ),
        Layout(
            "ulysses",
            "DeepSpeed UlyssesSPAttentionHF.register_with_transformers; weights all (nothing"
            " checkpointed), tokens 1/D",
            layouts.build_ulysses,
            _sequence,
            process_wide=True,
        ),
        Layout(
            "tpxsp",
            "torch TP on tp (inside) x DeepSpeed Ulysses on sp (across); weights 1/tp, tokens 1/sp",
            layouts.build_tpxsp,
            layouts.tpxsp_split,
            process_wide=True,
        ),
        Layout(
            "ring",
            "torch context_parallel (ring attention); weights all, tokens 1/D",
            layouts.build_ring,
            _sequence,
        ),
        Layout(
            "ulysses_zero3",
            "DeepSpeed ZeRO-3 over the SP ranks + Ulysses + HF checkpointing; weights 1/D,"
            " tokens 1/D",
            layouts.build_ulysses_zero3,
            _sequence,
            process_wide=True,
            in_sweep=False,
        ),
        Layout(
            "alst",
            "ulysses_zero3 + TiledMLP + TiledFusedLogitsLoss + offload: Arctic Long Sequence"
            " Training as DeepSpeed ships it (arXiv 2506.13996)",
            functools.partial(layouts.build_ulysses_zero3, tiled=True),
            _sequence,
            process_wide=True,
        ),
        Layout(
            "dpo_single",
            "DPO, one process, HF layer checkpointing, the reference a frozen copy",
            dpo_layouts.build_dpo_single,
            _one,
            in_sweep=False,
            preference=True,
        ),
        Layout(
            "dpo_tsp_long",
            "DPO under tsp_long's TSPConfig, the reference a frozen TSP model on the same mesh",
            _tsp(dpo_layouts.build_dpo_tsp, **_LONGEST),
            _folded,
            in_sweep=False,
            preference=True,
        ),
        Layout(
            "dpo_alst",
            "DPO from alst's parts, the reference a ZeRO-3 engine without optimizer",
            dpo_layouts.build_dpo_alst,
            _sequence,
            process_wide=True,
            in_sweep=False,
            preference=True,
        ),
    )
}
LAYOUTS = tuple(REGISTRY)
# the layouts of the language-model training step (``benchmarks.run``, ``profile_step``)
TRAINING_LAYOUTS = tuple(n for n, e in REGISTRY.items() if not e.preference)
# what a sweep runs unless told: every training layout but the steps between TSP's defaults and
# tsp_long and between Ulysses and ALST, and the adapters (select those by name)
SWEEP_LAYOUTS = tuple(n for n, e in REGISTRY.items() if e.in_sweep)


def lookup(layout: str) -> Layout:
    """The entry of ``layout``; ``ValueError`` naming the layouts if there is none."""
    if layout not in REGISTRY:
        raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    return REGISTRY[layout]


def tp_sp_split(layout: str, devices: int) -> tuple[int, int]:
    """(tp, sp) sizes of ``layout`` on ``devices`` ranks."""
    return lookup(layout).split(devices)


def layouts_help() -> str:
    """The layouts and what each is, one line each (the CLIs' ``--help``)."""
    return "\n".join(f"{e.name}: {e.about}" for e in REGISTRY.values())
