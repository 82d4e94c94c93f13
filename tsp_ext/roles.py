"""How each parameter of a TSP model is laid out over the TSP axis (for DP engines and norms)."""

from __future__ import annotations

import enum

import torch.distributed as dist
from torch import nn

from .attention import TSPAttention
from .mlp import TSPGatedMLP
from .vocab import TSPVocabEmbedding, TSPVocabLMHead


class Role(enum.Enum):
    SHARDED = "sharded"  # a distinct slice on every TSP rank: counted on every rank
    REPLICATED = "replicated"  # the same tensor on every TSP rank: counted once
    COPY = "copy"  # a replicated KV head held by a rank that is not its first owner: not counted


def param_roles(model: nn.Module) -> dict[str, Role]:
    """``{parameter name: Role}`` for every parameter of a TSP model (names as in the model).

    When D > n_kv_heads a KV head lives on D/n_kv ranks; only its first owner counts it (a
    gradient norm must see each distinct value once).
    """
    roles: dict[str, Role] = {}
    for mod_name, mod in model.named_modules():
        if not isinstance(mod, (TSPAttention, TSPGatedMLP, TSPVocabEmbedding, TSPVocabLMHead)):
            continue
        first_owner = True
        if isinstance(mod, TSPAttention):
            first_owner = dist.get_rank(mod.group) % mod.spec.kv_replicas == 0
        for local in mod.shard_dims:
            kv = local.startswith(("k_proj.", "v_proj."))
            role = Role.SHARDED if first_owner or not kv else Role.COPY
            roles[f"{mod_name}.{local}"] = role
    names = [n for n, _ in model.named_parameters()]
    return {n: roles.get(n, Role.REPLICATED) for n in names}
