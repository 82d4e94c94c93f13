"""PEFT LoRA adapters on TSP modules: each adapter follows the fold of the weight it adapts.

``apply_tsp`` on a ``peft.PeftModel`` (LoRA) takes every adapted projection's PEFT layer off the
Hugging Face module (``detach_adapters``), builds the TSP module from the plain one as usual,
then wraps the TSP module's projection in a ``TSPLoraLinear`` holding the adapter's share
(``attach_adapters``):

* q/k/v/gate/up (base cut by output rows): ``lora_B`` rows sharded with the base, ``lora_A``
  replicated;
* o/down (base cut by input columns): ``lora_A`` columns sharded with the base, ``lora_B``
  replicated.

Parameter names stay PEFT's (``q_proj.base_layer.weight``, ``q_proj.lora_A.default.weight``), so
``full_state_dict`` / ``full_grads`` / DCP see the PEFT model's names, and the PEFT tooling that
walks ``BaseTunerLayer`` modules (``disable_adapter``, ``merge_and_unload``: local merges, no
communication) works on the TSP model. The schedules compute the adapter terms
(``engine.adapters.lora``); the base shards are frozen and get no gradient GEMMs. A PEFT model
built on a model that is already a TSP model (``load_pretrained``, then ``get_peft_model``) has
adapters of the shards' shapes already: ``apply_tsp`` on it folds them (``fold_on_shards``).
"""

from __future__ import annotations

import functools
import math
import struct
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..engine.adapters.lora import LoraPlan
from ..engine.parallel import comm
from ..engine.parallel.agreement import agree
from .families import family_of
from .sharding import Role, ShardedModule

PEFT_PREFIX = "base_model.model."  # a PeftModel's names: this + the Hugging Face model's
ADAPTER_MARK = ".lora_"  # in the name of every LoRA parameter (``q_proj.lora_A.default.weight``)
# the projections TSP shards, by side: output rows (B sharded) / input columns (A sharded)
ROW_SHARDED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
COL_SHARDED = ("o_proj", "down_proj")


def peft_base(model: nn.Module) -> nn.Module | None:
    """The Hugging Face model inside a ``peft.PeftModel`` (None if ``model`` is not one)."""
    if "peft" not in sys.modules:  # no PEFT model can exist: do not import it (time, memory)
        return None
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else None


def is_lora_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a PEFT tuner layer (any method) or a ``modules_to_save`` copy."""
    if "peft" not in sys.modules:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    return isinstance(module, (BaseTunerLayer, ModulesToSaveWrapper))


def check_peft_model(peft_model: nn.Module) -> str:
    """The one LoRA adapter's name, after checking that TSP can fold the PEFT model: LoRA only,
    one adapter, on the seven projections only, no DoRA / LoRA bias / modules_to_save;
    ``ValueError`` naming what to change otherwise."""
    configs = peft_model.peft_config
    if len(configs) != 1:
        raise ValueError(
            f"TSP folds exactly one LoRA adapter, the model has {sorted(configs)}: delete the "
            "others (delete_adapter) or merge them first"
        )
    name, config = next(iter(configs.items()))
    kind = getattr(config.peft_type, "value", config.peft_type)
    if kind != "LORA":
        raise ValueError(f"TSP supports LoRA adapters only, the model has a {kind} adapter")
    if getattr(config, "use_dora", False):
        raise ValueError("DoRA (use_dora=True) is not supported under TSP: use plain LoRA")
    if getattr(config, "lora_bias", False):
        raise ValueError("lora_bias=True is not supported under TSP: set lora_bias=False")
    if getattr(config, "modules_to_save", None):
        raise ValueError(
            f"modules_to_save={config.modules_to_save} is not supported under TSP: train those "
            "modules by full fine-tuning or leave them out"
        )
    if getattr(config, "bias", "none") != "none":
        raise ValueError(f"bias={config.bias!r} is not supported under TSP: use bias='none'")
    base = peft_model.get_base_model()
    family = family_of(base)
    allowed = {
        id(getattr(block, p))
        for layer in family.layers_of(base)
        for block, names in family.projection_blocks(layer)
        for p in names
        if hasattr(block, p)
    }
    for module_name, module in base.named_modules():
        if is_lora_layer(module) and id(module) not in allowed:
            if module_name.rpartition(".")[2] in {f for f, _ in family.fused}:
                fused = ", ".join(f for f, _ in family.fused)
                raise ValueError(
                    f"LoRA on {module_name} is not supported under TSP: the {family.name} "
                    f"family stacks its projections ({fused}), and TSP folds adapters on "
                    "separate ones only"
                )
            raise ValueError(
                f"LoRA on {module_name} is not supported under TSP: target only "
                f"{', '.join(family.attention_projections + family.mlp_projections)} (not the "
                "embedding, the LM head or other modules)"
            )
        if is_lora_layer(module):
            variants = getattr(module, "lora_variant", {})
            if variants:
                raise ValueError(f"{module_name}: LoRA variant {variants} is not supported")
    return name


def _fingerprint(t: torch.Tensor) -> int:
    """An integer equal on two ranks exactly when (in practice) ``t`` is: two weighted sums'
    float64 bits, folded."""
    flat = t.detach().double().flatten()
    ramp = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    sums = struct.pack("<dd", flat.sum().item(), (flat * ramp).sum().item())
    return zlib.crc32(sums)


def check_adapters_agree(peft_model: nn.Module, group, values: bool = True) -> None:
    """Raise the same ``ValueError`` on every TSP rank if the ranks' adapters differ (config or,
    with ``values``, values: replicated pieces must start equal, e.g. ``get_peft_model`` under
    the same seed)."""
    layers = [(n, m) for n, m in peft_model.get_base_model().named_modules() if is_lora_layer(m)]
    config = repr(
        [(n, dict(m.r), dict(m.scaling), repr(m.lora_dropout)) for n, m in layers]
    ).encode()
    digest = 0
    for _, m in layers if values else ():
        for p in (*m.lora_A.parameters(), *m.lora_B.parameters()):
            digest = zlib.crc32(digest.to_bytes(8, "little"), _fingerprint(p))
    table = agree(None, [zlib.crc32(config), digest], group)
    if (table != table[0]).any():
        what = "configs" if (table[:, 0] != table[0, 0]).any() else "initial values"
        raise ValueError(
            f"the LoRA adapter {what} differ across TSP ranks: build the PEFT model identically "
            "on every rank (same LoraConfig, and torch.manual_seed before get_peft_model)"
        )


def detach_adapters(block: nn.Module, names: tuple[str, ...]) -> dict[str, nn.Module]:
    """Put each PEFT-wrapped projection of ``block`` back to its base layer; returns the PEFT
    layers taken off, by projection name."""
    taken = {}
    for name in names:
        module = getattr(block, name, None)
        if module is not None and is_lora_layer(module):
            taken[name] = module
            setattr(block, name, module.get_base_layer())
    return taken


def _adapter(peft_layer: nn.Module, adapter: str):
    """``(A [r, in], B [out, r], scaling, dropout p, alpha)`` of a PEFT LoRA layer's adapter."""
    dropout = peft_layer.lora_dropout[adapter]
    p = dropout.p if isinstance(dropout, nn.Dropout) else 0.0
    return (
        peft_layer.lora_A[adapter].weight,
        peft_layer.lora_B[adapter].weight,
        float(peft_layer.scaling[adapter]),
        p,
        peft_layer.lora_alpha[adapter],
    )


def _drawn_on_shards(a: torch.Tensor, on_shards, rows_of, *, D: int, p: int) -> torch.Tensor:
    """A that PEFT initialised on a shard, drawn again from ``on_shards = (init, generator)``
    (the generator in the same state on every rank): the full ``[r, in]`` A of PEFT's init
    (``rows_of`` None: a row-sharded projection's replicated A) or rank p's columns of it (a
    column-sharded one's). PEFT's own draws follow the shards' shapes, which differ between the
    ranks of an uneven split, so its generator states part after the first one."""
    init, generator = on_shards
    width = a.shape[1] if rows_of is None else max(rows_of(q).stop for q in range(D))
    full = torch.empty(a.shape[0], width, dtype=a.dtype)
    if init == "gaussian":
        nn.init.normal_(full, std=1 / a.shape[0], generator=generator)
    else:
        nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
    mine = full if rows_of is None else full[:, rows_of(p)]
    return mine.to(a.device).clone().requires_grad_(a.requires_grad)


def _linear(weight: torch.Tensor, requires_grad: bool) -> nn.Linear:
    """An ``nn.Linear`` (no bias) holding a copy of ``weight [out, in]``."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = nn.Parameter(weight.detach().clone(), requires_grad=requires_grad)
    return lin


def _tuner_base():
    from peft.tuners.tuners_utils import BaseTunerLayer

    return BaseTunerLayer


@dataclass(frozen=True)
class AdapterShare:
    """This rank's share of one projection's LoRA adapter ``name``: ``a``, ``b`` (``A [r, in]``
    and ``B [out_p, r]`` rows on side ``"rows"``, or ``A [r, in_p]`` columns and ``B [out, r]``
    on side ``"cols"``), its scale ``s``, ``lora_alpha`` and ``dropout``."""

    name: str
    a: torch.Tensor
    b: torch.Tensor
    s: float
    lora_alpha: float
    dropout: float


class TSPLoraLinear(ShardedModule):
    """One projection's base shard (``base_layer``, frozen) and its LoRA adapter's share.

    ``rows_of(rank)`` is the slice of the base's sharded dim held by ``rank`` (the parent TSP
    module's layout); ``side`` is ``"rows"`` (q/k/v/gate/up: B sharded with the base, A
    replicated) or ``"cols"`` (o/down: A sharded, B replicated). Acts as a PEFT
    ``BaseTunerLayer`` (``disable_adapters``, ``merge``): see ``lora_class``.
    """

    adapter_layer_names = ("lora_A", "lora_B")
    other_param_names = ("r", "lora_alpha", "scaling", "lora_dropout")

    def __init__(
        self,
        base_layer: nn.Linear,
        share: AdapterShare,
        *,
        side: str,
        rows_of: Callable[[int], slice],
        parent_role: Callable[[], tuple[Role, tuple[slice, ...]]] | None,
        group,
    ) -> None:
        """``share``: this rank's share of the adapter (its tensors copied)."""
        nn.Module.__init__(self)
        self.base_layer, self.side, self.group = base_layer, side, group
        self._rows_of, self._parent_role = rows_of, parent_role
        adapter, a, b, dropout = share.name, share.a, share.b, share.dropout
        self._active_adapter, self._disable_adapters, self.merged_adapters = adapter, False, []
        s, alpha = share.s, share.lora_alpha
        self.r, self.p = {adapter: a.shape[0]}, dropout
        self.scaling, self.lora_alpha = {adapter: s}, {adapter: alpha}  # PEFT's status reads both
        self.lora_A = nn.ModuleDict({adapter: _linear(a, a.requires_grad)})
        self.lora_B = nn.ModuleDict({adapter: _linear(b, b.requires_grad)})
        drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.lora_dropout = nn.ModuleDict({adapter: drop})
        a_key, b_key = f"lora_A.{adapter}.weight", f"lora_B.{adapter}.weight"
        dim = {"rows": 0, "cols": 1}[side]
        self.shard_dims = {"base_layer.weight": dim, (b_key if side == "rows" else a_key): dim}
        if side == "rows" and base_layer.bias is not None:
            self.shard_dims["base_layer.bias"] = 0
        self.base_layer.requires_grad_(False)

    # --- the sharded-module protocol ------------------------------------------------------
    def index_of(self, name: str, rank: int) -> tuple[slice, ...]:
        if name not in self.shard_dims:
            return (slice(None),)
        rows = self._rows_of(rank)
        return (rows,) if self.shard_dims[name] == 0 else (slice(None), rows)

    def counted_index(self, name: str) -> tuple[slice, ...]:
        """Rows of a shared KV head count once (as the parent attention's K/V shards)."""
        if name in self.shard_dims and self._parent_role is not None:
            return self._parent_role()[1]
        return super().counted_index(name)

    def role(self, name: str) -> Role:
        if name in self.shard_dims and self._parent_role is not None:
            return self._parent_role()[0]
        return super().role(name)

    # --- what the schedules take -----------------------------------------------------------
    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    @property
    def active(self) -> bool:
        """Whether the adapter takes part (not disabled, not merged into the base)."""
        return not self._disable_adapters and not self.merged_adapters

    @property
    def adapter_name(self) -> str:
        name = self._active_adapter  # PEFT's set_adapter stores a list
        return name if isinstance(name, str) else name[0]

    @property
    def a(self) -> torch.Tensor:
        return self.lora_A[self.adapter_name].weight

    @property
    def b(self) -> torch.Tensor:
        return self.lora_B[self.adapter_name].weight

    @property
    def s(self) -> float:
        return self.scaling[self.adapter_name]

    def delta(self) -> torch.Tensor:
        """``s · B · A`` on this rank's shard of the base (local on both sides)."""
        return (self.b @ self.a).mul_(self.s).to(self.weight.dtype)

    def merged_weight(self) -> torch.Tensor:
        """The base shard with the adapter added (inference); the shard itself when inactive."""
        return self.weight + self.delta() if self.active else self.weight

    # --- PEFT's BaseTunerLayer behaviour ---------------------------------------------------
    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Add ``s·B·A`` into the base shard (local: no communication)."""
        if self.merged_adapters:
            return
        if not isinstance(self.base_layer, nn.Linear):
            raise ValueError(
                "the base is NF4-quantized (QLoRA): merging would round the adapter to 4 bits; "
                "save the adapter (save_pretrained) or export the merged model with "
                "tsp_ext.save_pretrained(model, path, merge_adapter=True)"
            )
        with torch.no_grad():
            merged = self.weight + self.delta()
            if safe_merge and not torch.isfinite(merged).all():
                raise ValueError("NaNs detected in the merged weights: the adapter seems broken")
            self.weight.copy_(merged)
        self.merged_adapters = [self.adapter_name]

    def unmerge(self) -> None:
        if not self.merged_adapters:
            return
        with torch.no_grad():
            self.weight.sub_(self.delta())
        self.merged_adapters = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(
            "a TSP LoRA projection is computed by its attention / MLP schedule, not called alone"
        )


@functools.cache
def lora_class() -> type:
    """``TSPLoraLinear`` mixed with PEFT's ``BaseTunerLayer`` (PEFT is imported only when a
    PEFT model is folded), so that PEFT's module walks find it."""
    return type("TSPLoraLinear", (TSPLoraLinear, _tuner_base()), {})


def attach_adapters(
    module: ShardedModule, taken: dict[str, nn.Module], adapter: str, on_shards=None
) -> None:
    """Wrap each of ``module``'s projections in ``taken`` (PEFT layers from ``detach_adapters``)
    in a ``TSPLoraLinear`` with this rank's share of its adapter: sliced from the full adapter,
    or, with ``on_shards`` (the adapter's ``init_lora_weights`` and a generator in the same
    state on every rank), the adapter PEFT made on the shard itself (``get_peft_model`` after
    ``apply_tsp``), its A drawn again (``_drawn_on_shards``; B is zero)."""
    rank_role = getattr(module, "role", None)
    D, p = comm.size_and_rank(module.group)
    for name, peft_layer in taken.items():
        a, b, scaling, dropout, alpha = _adapter(peft_layer, adapter)
        key = f"{name}.weight"
        side = "rows" if name in ROW_SHARDED else "cols"
        dim = module.shard_dims[key]

        def rows_of(rank: int, key=key, dim=dim) -> slice:
            return module.index_of(key, rank)[dim]

        if on_shards is None:
            a, b = (a, b[rows_of(p)]) if side == "rows" else (a[:, rows_of(p)], b)
        else:
            a = _drawn_on_shards(a, on_shards, rows_of if side == "cols" else None, D=D, p=p)

        parent_role = None
        if name in ("k_proj", "v_proj") and rank_role is not None:

            def parent_role(key=key):
                return module.role(key), module.counted_index(key)

        base = getattr(module, name)
        share = AdapterShare(adapter, a, b, s=scaling, lora_alpha=alpha, dropout=dropout)
        wrapped = lora_class()(
            base, share, side=side, rows_of=rows_of, parent_role=parent_role, group=module.group
        )
        setattr(module, name, wrapped)


def fold_on_shards(peft_model: nn.Module) -> None:
    """Fold the LoRA layers that ``get_peft_model`` put on an already-TSP model's shards (e.g.
    one from ``load_pretrained``): their A / B have the shard's shapes already; every A is
    drawn again from one generator seeded alike on every rank (``attach_adapters``). Inits that
    read the full base weight (PiSSA, OLoRA, LoftQ, ...) are refused: build the PEFT model
    before ``apply_tsp`` for those."""
    adapter = check_peft_model(peft_model)
    init = peft_model.peft_config[adapter].init_lora_weights
    if init not in (True, "gaussian"):
        raise ValueError(
            f"init_lora_weights={init!r} reads the full base weights: call get_peft_model on the "
            "full model, then apply_tsp"
        )
    base = peft_model.get_base_model()
    check_adapters_agree(peft_model, base.tsp.group, values=False)
    seed = int(torch.randint(0, 2**62, (1,)))  # the caller's seed; rank 0's is used everywhere
    generator = torch.Generator().manual_seed(int(agree(None, [seed], base.tsp.group)[0, 0]))
    family = base.tsp.family
    for layer in family.layers_of(base):
        for block, names in family.projection_blocks(layer):
            taken = detach_adapters(block, names)
            attach_adapters(block, taken, adapter, on_shards=(init, generator))


def adapters_of(module: nn.Module, names: tuple[str, ...]) -> dict[str, TSPLoraLinear]:
    """``module``'s active LoRA projections among ``names``."""
    out = {}
    for name in names:
        proj = getattr(module, name)
        if isinstance(proj, TSPLoraLinear):
            if proj.active:
                out[name] = proj
        elif is_lora_layer(proj):
            raise ValueError(
                f"{type(module).__name__}.{name} is a PEFT layer that TSP has not folded (added "
                "after apply_tsp): call apply_tsp(peft_model) on the PEFT model to fold its "
                "adapters"
            )
    return out


def plan_of(
    adapted: dict[str, TSPLoraLinear], inputs: tuple[str, ...], output: str, training: bool
) -> LoraPlan:
    """The engine's ``LoraPlan`` for the adapted projections (``inputs``: the row-sharded ones in
    stacking order, ``output``: the column-sharded one); dropout only in training mode."""
    present = [n for n in inputs if n in adapted]
    drops = {adapted[n].p for n in adapted}
    if len(drops) > 1:
        raise ValueError(f"adapters of one module with different lora_dropout: {sorted(drops)}")
    return LoraPlan(
        inputs=tuple(n.removesuffix("_proj") for n in present),
        scalings=tuple(adapted[n].s for n in present),
        output=adapted[output].s if output in adapted else None,
        dropout=drops.pop() if drops and training else 0.0,
    )
