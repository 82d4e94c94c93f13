"""The command-line arguments the recipes share (``finetune_long_llama.py``, ``sft_trainer.py``,
``dpo.py``, ``grpo.py``): the model, the data, the TSP size, the optimisation and evaluation."""

from __future__ import annotations

import argparse
import warnings

import torch
from _data import SHAKESPEARE
from _gguf import DEFAULT_CACHE, SHORTCUTS
from _presets import PRESETS

from tsp_ext.dp.engines import ENGINES

# what --data-parallel deepspeed needs in a recipe that runs DDP / FSDP2 only
DEEPSPEED_INSTEAD = (
    "for DeepSpeed ZeRO run finetune_long_llama.py --data-parallel deepspeed, or give TSPTrainer "
    "TrainingArguments(deepspeed=...) (docs/deepspeed.md)"
)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the RoPE scalings TSP folds exactly: each position's rotation depends on the position alone
ROPE_SCALINGS = ("yarn", "llama3", "linear")


def rope_scaling(name: str) -> str:
    """``--rope-scaling``: one of ``ROPE_SCALINGS``; any other type refused, saying why."""
    if name in ROPE_SCALINGS:
        return name
    raise argparse.ArgumentTypeError(
        f"{name!r}: TSP runs {', '.join(ROPE_SCALINGS)} RoPE scaling (and a larger base alone, "
        "--rope-theta); dynamic / longrope scalings change with the sequence's length, which no "
        "TSP rank sees whole"
    )


def add_shared_args(p: argparse.ArgumentParser, documents: bool = True) -> None:
    """The shared arguments, with their defaults (a recipe changes some by ``set_defaults``).
    ``documents=False`` (a recipe that trains on prompts): no ``--dataset`` of documents, and
    none of the flags that cut documents into blocks (``--text-column``, ``--seq-len``,
    ``--packing``, ``--eval-blocks``)."""
    p.add_argument(
        "--model",
        default="tiny-llama",
        help=f"a preset {list(PRESETS)}, a checkpoint directory / hub id, a .gguf file or "
        f"{list(SHORTCUTS)}",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="path / hub id (default: the model's own; for a preset a BPE trained on the data)",
    )
    p.add_argument("--vocab-size", type=int, default=2048, help="for the trained BPE")
    p.add_argument(
        "--cache-dir", default=DEFAULT_CACHE, help="where GGUF files are converted to checkpoints"
    )
    if documents:
        p.add_argument(
            "--dataset",
            default=SHAKESPEARE,
            help="shakespeare, text:<glob>, json:<glob> or a hub name",
        )
        p.add_argument("--text-column", default="text", help="the dataset's column of documents")
        p.add_argument("--seq-len", type=int, default=4096, help="tokens per training sequence")
        p.add_argument(
            "--packing",
            choices=("stream", "documents"),
            default="stream",
            help="stream: documents joined by EOS into one causal stream; documents: whole "
            "documents per row, attention and positions per document",
        )
    add_rope_args(p)
    p.add_argument("--tsp-size", type=int, default=None, help="default: all processes")
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences per TSP group")
    p.add_argument("--gradient-accumulation-steps", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--eval-every", type=int, default=20)
    if documents:
        p.add_argument("--eval-blocks", type=int, default=2, help="held-out blocks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--lora-r",
        type=int,
        default=0,
        help="LoRA rank: train a PEFT LoRA adapter (0: all weights)",
    )
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: 2 x r)")
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument(
        "--qlora",
        action="store_true",
        help="with --lora-r: the frozen base stored and sent 4-bit (NF4), as QLoRA",
    )
    p.add_argument(
        "--lora-targets",
        default=",".join(LORA_TARGETS),
        help="comma-separated projections that get an adapter",
    )


def add_rope_args(p: argparse.ArgumentParser) -> None:
    """``--rope-scaling`` / ``--rope-factor`` / ``--rope-theta`` / ``--max-position``: the
    context extension (``_model.extend_context``), in training and in evaluation."""
    p.add_argument(
        "--rope-scaling",
        type=rope_scaling,
        default=None,
        metavar="{" + ",".join(ROPE_SCALINGS) + "}",
        help="extend the context by RoPE scaling (with --rope-factor or --max-position)",
    )
    p.add_argument(
        "--rope-factor", type=float, default=None, help="new context / the model's (> 1)"
    )
    p.add_argument("--rope-theta", type=float, default=None, help="a larger RoPE base (ABF)")
    p.add_argument(
        "--max-position",
        type=int,
        default=None,
        help="the extended context (default: factor x the model's max_position_embeddings)",
    )


def add_data_parallel_arg(
    p: argparse.ArgumentParser,
    supported: tuple[str, ...] = tuple(ENGINES),
    instead: str = "",
    old_name: str | None = None,
) -> None:
    """``--data-parallel``: the data-parallel engine over the dp axis (``tsp_ext.dp.engines``,
    TSPTrainer's ``data_parallel=``), one of the ``supported``; ``instead``: what to use for the
    others; ``old_name``: a former spelling that still works, with a FutureWarning."""

    def engine(name: str) -> str:
        if name in supported:
            return name
        if name in ENGINES:
            raise argparse.ArgumentTypeError(
                f"{name!r}: this recipe runs {', '.join(supported)}; {instead}"
            )
        raise argparse.ArgumentTypeError(f"{name!r}: choose one of {', '.join(supported)}")

    p.add_argument(
        "--data-parallel",
        type=engine,
        default="ddp",
        metavar="{" + ",".join(supported) + "}",
        help="the data-parallel engine over the dp replicas (default: ddp)",
    )
    if old_name:
        p.add_argument(
            old_name,
            dest="data_parallel",
            type=engine,
            action=DeprecatedAlias,
            help=argparse.SUPPRESS,
        )


class DeprecatedAlias(argparse.Action):
    """An old spelling of ``--data-parallel`` that still works, with a FutureWarning."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        msg = f"{option_string} is deprecated: use --data-parallel {values}"
        warnings.warn(msg, FutureWarning, stacklevel=2)
        setattr(namespace, self.dest, values)


def trainer_settings(args: argparse.Namespace) -> dict:
    """The ``TrainingArguments`` fields the shared arguments set, for the Trainer recipes
    (``sft_trainer.py``, ``dpo.py``, ``grpo.py``), which add their own."""
    return dict(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.micro_batch_size,
        per_device_eval_batch_size=1,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        warmup_steps=args.warmup_steps,
        max_grad_norm=args.max_grad_norm,
        bf16=args.bf16,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=args.eval_every,
        report_to=[],
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
    )
