"""Write a recipe model shortcut (or any GGUF file) as a plain Hugging Face checkpoint folder, for
one's own scripts:

    python recipes/export_model.py smollm2-135m outputs/smollm2-135m

then ``AutoModelForCausalLM.from_pretrained("outputs/smollm2-135m")`` in one's own script.

The folder holds ``config.json`` (with ``architectures``), float32 safetensors and the tokenizer:
what ``from_pretrained`` and the recipes' ``--model`` take. The GGUF file is converted tensor by
tensor (``_gguf.convert``), never holding the model; an existing folder is left as it is.
"""

from __future__ import annotations

import argparse
import os

from _gguf import SHORTCUTS, convert, gguf_file


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help=f"a shortcut {list(SHORTCUTS)} or a .gguf file")
    p.add_argument("out_dir", help="the Hugging Face checkpoint folder to write")
    args = p.parse_args(argv)
    path = gguf_file(args.model)
    if path is None:
        p.error(f"{args.model}: give a shortcut {list(SHORTCUTS)} or a .gguf file")
    if os.path.exists(args.out_dir):
        raise SystemExit(f"{args.out_dir} exists: give a new folder")
    convert(path, args.out_dir)
    print(f"{args.model}: Hugging Face checkpoint in {args.out_dir}")


if __name__ == "__main__":
    main()
