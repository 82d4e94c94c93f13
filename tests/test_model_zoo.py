"""Every causal LM of the pinned transformers under ``apply_tsp`` at D = 1 and D = 2: exact
against the unmodified model, or refused with a ``ValueError`` saying why; none answers wrong,
crashes with another error or hangs. The outcomes are the table in ``docs/apply_tsp.md``."""

from __future__ import annotations

import copy

import pytest
import torch
from model_zoo import (
    GRAD_TOL,
    LOGITS_TOL,
    LOSS_TOL,
    ROOT,
    doc_rows,
    model_types,
    table_rows,
    zoo_config,
    zoo_worker,
)

from tsp_ext.hf.miniature import build_miniature

pytestmark = pytest.mark.multiproc

TYPES = model_types()
STATUSES = ("exact", "refused", "no miniature")
GROUPS = 8  # one kept-rank task per group of model types (a hang fails one group, not the run)


@pytest.mark.parametrize("group", range(GROUPS))
def test_every_causal_lm_is_exact_or_refused(workers, group):
    types = TYPES[group::GROUPS]
    results = workers.run(zoo_worker, 2, types, timeout=420)
    assert results[0] == results[1], "the two ranks disagree"
    outcomes = results[0]
    for t, row in outcomes.items():
        assert "crash" not in row["status"].values(), (t, row["why"])
        for D, status in row["status"].items():
            assert status in STATUSES, (t, D, status)
            if status == "exact":
                assert row["layers"] >= 1, (t, "a miniature without decoder layers proves nothing")
                errors = row["errors"][D]
                assert errors["logits"] < LOGITS_TOL, (t, D, errors)
                assert errors["eval_logits"] < LOGITS_TOL, (t, D, errors)
                assert errors["loss"] < LOSS_TOL, (t, D, errors)
                assert errors["gradients"] < GRAD_TOL, (t, D, errors)
            else:
                assert row["why"][D], (t, D, "a refusal says why")
    documented = {r[0]: r for r in doc_rows()}
    for row in table_rows(outcomes, 2):
        assert documented.get(row[0]) == row, (
            f"docs/apply_tsp.md's zoo table says {documented.get(row[0])}, the test found {row}: "
            "rewrite the table with `python tests/model_zoo.py`"
        )


def test_a_miniature_keeps_one_decoder_layer_of_every_kind():
    """Its layers are the model's top-level list (not the experts inside a layer, a longer list)
    and its count is the config's that builds them (LongCat-Flash's ``num_layers``)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from tsp_ext.hf.miniature import decoder_layers

    dense_then_moe = Qwen3MoeConfig(num_hidden_layers=48, num_experts=128, mlp_only_layers=[0])
    config = zoo_config("longcat_flash")
    kept = {}
    for name, c in (("qwen3_moe", dense_then_moe), ("longcat_flash", config)):
        model = build_miniature(AutoModelForCausalLM._model_mapping[type(c)], c)
        kept[name] = [type(layer.mlp).__name__ for layer in decoder_layers(model)]
    assert kept == {
        "qwen3_moe": ["Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock"],
        "longcat_flash": ["LongcatFlashMoE"],
    }


def test_the_table_lists_every_type_and_the_readme_counts_it():
    rows = doc_rows()
    assert sorted(r[0] for r in rows) == sorted(f"`{t}`" for t in TYPES)
    exact, refused, unbuilt = (sum(r[3] == s for r in rows) for s in STATUSES)
    readme = " ".join((ROOT / "README.md").read_text().split())
    quoted = f"{exact} exact, {refused} refused with the reason, {unbuilt} that no small model"
    assert quoted in readme


def refusal_worker(rank, world):
    import torch
    from transformers import AutoModelForCausalLM

    from tsp_ext import TSPConfig, apply_tsp, init_tsp_mesh

    mesh = init_tsp_mesh(world)
    config = zoo_config("smollm3")  # NoPE on every 4th layer: folded wrong before the check
    model = build_miniature(AutoModelForCausalLM._model_mapping[type(config)], config)
    before = copy.deepcopy(model.state_dict())
    try:
        apply_tsp(model, mesh)
        message = "<no error>"
    except ValueError as e:
        message = str(e)
    after = model.state_dict()
    untouched = (
        getattr(model, "tsp", None) is None
        and all(torch.equal(before[k], after[k]) for k in before)
        and before.keys() == after.keys()
    )
    unchecked = apply_tsp(model, mesh, config=TSPConfig(self_check=False))
    return message, untouched, unchecked.tsp.config.self_check


def test_a_mismatch_names_the_first_module_and_moves_nothing(workers):
    results = workers.run(refusal_worker, 2)
    assert results[0][0] == results[1][0]  # every rank raises the same error
    message, untouched, checked = results[0]
    assert "SmolLM3ForCausalLM (model_type='smollm3') is not supported under TSP" in message
    # layer 3 is the first without RoPE: its attention is the first module that differs
    assert "different output of model.layers.3.self_attn" in message
    assert "relative error" in message and "TSPConfig(self_check=False)" in message
    assert untouched, "a refused model keeps its modules and weights"
    assert checked is False  # self_check=False folds without the proof


def rng_worker(rank, world):
    import torch
    from transformers import AutoModelForCausalLM

    from tsp_ext import TSPConfig, apply_tsp, init_tsp_mesh
    from tsp_ext.hf import self_check

    mesh = init_tsp_mesh(world)
    config = zoo_config("llama")
    model = build_miniature(AutoModelForCausalLM._model_mapping[type(config)], config)
    base = copy.deepcopy(model.config)  # before the fold changes its attention function
    self_check._proven.clear()
    torch.manual_seed(100 + rank)  # every rank's random state differs
    state = torch.get_rng_state()
    self_check.self_check(model, mesh, mesh["tsp"].get_group(), TSPConfig())  # proves the fold
    untouched = torch.equal(state, torch.get_rng_state())
    apply_tsp(model, mesh)  # the config proven: no check again
    proofs = [len(self_check._proven)]
    other_size = copy.deepcopy(base)  # what the miniature shrinks: the same miniature
    other_size.update({"head_dim": 12, "hidden_size": 32 * 12, "intermediate_size": 80})
    other_size.update({"vocab_size": 300, "num_hidden_layers": 3, "dtype": torch.float32})
    apply_tsp(type(model)(other_size), mesh)
    proofs.append(len(self_check._proven))
    other_flag = copy.deepcopy(base)  # a flag the miniature keeps: proven on its own
    other_flag.attention_bias = not config.attention_bias
    apply_tsp(type(model)(other_flag).double(), mesh)
    proofs.append(len(self_check._proven))
    return untouched, proofs


def test_the_self_check_is_the_same_on_every_rank_whatever_their_random_state(workers):
    """The miniature's weights and the check's batch come from fixed seeds, not the ranks' own
    random states (which the check leaves as they were): ranks seeded differently prove the same
    fold. A proof serves every model with the same miniature (another width, depth, vocabulary
    or dtype), not one that differs in a flag."""
    assert workers.run(rng_worker, 2) == [(True, [1, 1, 2])] * 2


def half_step_llama():
    """A Llama look-alike whose decoder layers add half of their update to the residual stream
    (its own layer forward): TSP's training path runs that forward, its inference path runs the
    layer as the Llama spec says, so only a check of the inference path can tell."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    class HalfStepLayer(LlamaDecoderLayer):
        def forward(self, hidden_states, *args, **kwargs):
            out = super().forward(hidden_states, *args, **kwargs)
            return hidden_states + 0.5 * (out - hidden_states)

    class HalfStepLlama(LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            self.model.layers = torch.nn.ModuleList(
                HalfStepLayer(config, i) for i in range(config.num_hidden_layers)
            )
            self.post_init()

    return HalfStepLlama


def inference_check_worker(rank, world):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tsp_ext import apply_tsp, init_tsp_mesh

    mesh = init_tsp_mesh(world)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    out = {}
    for name, cls in (("llama", LlamaForCausalLM), ("half_step", half_step_llama())):
        torch.manual_seed(0)
        model = apply_tsp(cls(copy.deepcopy(config)).double(), mesh)  # training: proven exact
        try:
            model.eval().generate(ids, max_new_tokens=2, do_sample=False)
            out[name] = "<no error>"
        except ValueError as e:
            out[name] = str(e)
    return out


def test_generate_proves_the_inference_path_first(workers):
    """A model whose training path is exact but whose layers do something the inference path
    does not: its first ``generate`` raises on every rank, naming the logits that differ; a
    supported model generates."""
    results = workers.run(inference_check_worker, 2)
    assert results[0] == results[1]
    assert results[0]["llama"] == "<no error>"
    message = results[0]["half_step"]
    assert "HalfStepLlama (model_type='llama') is not supported under TSP" in message, message
    assert "with a KV cache (generate)" in message and "logits after the prefill" in message
