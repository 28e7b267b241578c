"""Reading a GGUF (llama.cpp) model file: checking it, its tokenizer, and its model de-quantised.

A GGUF file holds a model's weights (usually quantised), its config and its tokenizer as metadata.
`check_gguf_file` reads the header alone: the metadata, and that every tensor it describes lies inside the file.
The de-quantisation is transformers' own GGUF load (`load_gguf_model`: `from_pretrained(..., gguf_file=)`, which
needs the `gguf` and `accelerate` packages: `check_gguf_dependencies`). checkpoint/gguf_sources.py turns a model
name or a GGUF file into a Hugging Face folder with these.

Tokenizer fixes. transformers builds a byte-level tokenizer from the file's vocabulary and merges but
ignores llama.cpp's pre-tokenizer name (`tokenizer.ggml.pre`) for names it does not know. SmolLM's
("smollm") splits every digit off before the GPT-2 split, as llama.cpp does for it and as SmolLM2's own
`tokenizer.json` does (`Digits(individual_digits=True)` before `ByteLevel`). Without it text such as
"a  12" tokenizes differently ("a", "Ġ", "Ġ", "1", "2" instead of "a", "ĠĠ", "1", "2"), so
`PRE_TOKENIZER_FIXES` restores it. It also ignores the file's `tokenizer.ggml.add_bos_token`: Gemma's says
true (its texts start with `<bos>`), so `load_gguf_tokenizer` sets it.
"""
from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any, Dict, Tuple, Union

PathLike = Union[str, os.PathLike]

GGUF_MAGIC = b"GGUF"
# Packages that reading a GGUF model needs (beyond transformers): pip name -> version tools/setup_env.sh pins.
GGUF_DEPENDENCIES = {"gguf": "0.19.0", "accelerate": "1.15.0"}


class GGUFSourceError(ValueError):
    """A model name or GGUF file that cannot be used: the message says why and what to do."""


# ------------------------------------------------------------------------------------------------
# Checking a GGUF file (cheap: nothing here reads tensor data)
# ------------------------------------------------------------------------------------------------
def check_gguf_file(path: Path) -> Dict[str, Any]:
    """The file's metadata (arrays as counts), after checking the magic bytes and that every tensor the
    header describes lies inside the file (a copy cut short fails here, before any work)."""
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise GGUFSourceError(f"{path}: not a GGUF file (it does not start with {GGUF_MAGIC!r})")
    from transformers.integrations.gguf.reader import read_gguf_metadata

    try:
        metadata, _ = read_gguf_metadata(str(path))
        end = _tensor_data_end(path)
    except GGUFSourceError:
        raise
    except Exception as error:  # struct.error, IndexError, UnicodeDecodeError, ValueError: all "unreadable"
        raise GGUFSourceError(f"{path}: unreadable GGUF header ({type(error).__name__}: {error})") from None
    size = path.stat().st_size
    if size < end:
        raise GGUFSourceError(f"{path}: truncated ({size} bytes, its header describes {end})")
    return metadata


def _tensor_data_end(path: Path) -> int:
    """Where the header says the last tensor's data ends.

    transformers' header class (GgufHeader) refuses quantisation types its own de-quantiser lacks, such as the
    Q5_0 tensors of Gemma 3's Q4_K_M file, which its model load de-quantises through the gguf package all the
    same; so the tensor table is read with transformers' reader functions and each type's size comes from gguf's
    table (every type llama.cpp writes).
    """
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError:
        check_gguf_dependencies()  # names the missing package and the pip command
        raise
    from transformers.integrations.gguf.reader import _mapped, _read_metadata, _read_tensor_table

    blob = _mapped(str(path))
    metadata, tensor_count, position = _read_metadata(blob, str(path))
    tensors, position = _read_tensor_table(blob, tensor_count, position)
    alignment = metadata.get("general.alignment", 32)  # llama.cpp's default
    data_start = (position + alignment - 1) // alignment * alignment  # the data follows the table, aligned

    def nbytes(ggml_type: int, shape: Tuple[int, ...]) -> int:
        block_elements, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        return math.prod(shape) // block_elements * block_bytes

    return max((data_start + offset + nbytes(ggml_type, shape) for _name, shape, ggml_type, offset in tensors),
               default=data_start)


def check_gguf_dependencies() -> None:
    """The packages transformers needs to de-quantise a GGUF model are installed (checked before any work)."""
    missing = [name for name in GGUF_DEPENDENCIES if importlib.util.find_spec(name) is None]
    if missing:
        pins = " ".join(f"{name}=={GGUF_DEPENDENCIES[name]}" for name in missing)
        raise GGUFSourceError(f"reading a GGUF model needs the package(s) {', '.join(missing)}: pip install {pins} "
                              f"(tools/setup_env.sh installs them)")


# ------------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------------
def _digits_then_byte_level():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])


# `tokenizer.ggml.pre` -> the pre-tokenizer the model's own tokenizer.json has, where transformers' GGUF
# reader builds another one (see the module docstring).
PRE_TOKENIZER_FIXES = {"smollm": _digits_then_byte_level}


def load_gguf_tokenizer(gguf_path: PathLike):
    """The tokenizer a GGUF file describes (transformers' GGUF reader plus `PRE_TOKENIZER_FIXES`).

    Reads only the metadata (vocabulary, merges, special tokens, chat template): a few seconds, no weights.
    """
    from transformers import AutoTokenizer

    path = Path(gguf_path)
    metadata = check_gguf_file(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    fix = PRE_TOKENIZER_FIXES.get(metadata.get("tokenizer.ggml.pre"))
    if fix is not None:
        tokenizer.backend_tokenizer.pre_tokenizer = fix()
    # transformers' GGUF reader ignores llama.cpp's add_bos/add_eos flags: Gemma's file says add_bos_token (every
    # Gemma text starts with <bos>, as its own tokenizer.json does), the tokenizer built here would not add it.
    for flag in ("add_bos_token", "add_eos_token"):
        wanted = metadata.get(f"tokenizer.ggml.{flag}")
        if wanted is not None and bool(wanted) != bool(getattr(tokenizer, flag)):
            setattr(tokenizer, flag, bool(wanted))  # the setter rebuilds the post-processor
            tokenizer.init_kwargs[flag] = bool(wanted)  # and tokenizer_config.json keeps it for a reload
    context = metadata.get(f"{metadata.get('general.architecture')}.context_length")
    if context:
        tokenizer.model_max_length = int(context)
    # Byte-level BPE: decoding must give the text back as it was, spaces before punctuation included.
    tokenizer.clean_up_tokenization_spaces = False
    for key in ("is_local", "local_files_only"):  # how this load found the file: not for tokenizer_config.json
        tokenizer.init_kwargs.pop(key, None)
    return tokenizer


# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------
def load_gguf_model(gguf_path: PathLike):
    """transformers' own load of a GGUF file, de-quantised to float32 (the reference the conversion matches)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(gguf_path)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)


def plain_config(model):
    """The model's config as a plain (unquantised, float32) config of its class, ready to save."""
    import torch

    values = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        values.pop(key, None)
    config = type(model.config).from_dict(values)
    config.architectures = [type(model).__name__]
    config.dtype = torch.float32
    return config
