"""Hugging Face model folders on disk: read them tensor by tensor, write them in bounded shards.

A Hugging Face causal-LM folder holds

    config.json                          the architecture
    model.safetensors                    the weights, in one file ...
    model-00001-of-0000N.safetensors     ... or in N shards named by
    model.safetensors.index.json         {"weight_map": {tensor name: shard file}}
    tokenizer.json, tokenizer_config.json, ...   the tokenizer (see TOKENIZER_FILES)
    generation_config.json               optional

`HFWeights` opens such a folder as a read-only mapping {name: tensor} that reads one tensor when asked
(safetensors files are memory-mapped), so a converter never holds the whole model in memory. It first
checks that the files are complete: every file the index names exists, every header parses, and every
file is as long as its header says (a copy cut short by a full disk or an interrupted download fails
here, with the file's name, before any work). `write_hf_weights` is the reverse: tensors arrive one by
one and leave in shards of bounded size, so memory holds at most one shard.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Tuple, Union

import torch

from hacpo_megatron.models.architectures import Architecture

PathLike = Union[str, os.PathLike]

CONFIG_FILE = "config.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# Files that make up a tokenizer in the formats transformers writes (fast and slow tokenizers).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # transformers' default `max_shard_size="5GB"`


class HFFolderError(ValueError):
    """A Hugging Face folder that cannot be read: the message names the folder and the file."""


# ------------------------------------------------------------------------------------------------
# config.json
# ------------------------------------------------------------------------------------------------
def read_hf_config(folder: PathLike) -> Dict[str, Any]:
    """config.json of a Hugging Face folder, as a dict."""
    path = Path(folder) / CONFIG_FILE
    if not Path(folder).is_dir():
        raise HFFolderError(f"{folder}: not a folder")
    if not path.is_file():
        raise HFFolderError(f"{folder}: no {CONFIG_FILE} (is this a Hugging Face model folder?)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise HFFolderError(f"{path}: not valid JSON ({error})") from None


# ------------------------------------------------------------------------------------------------
# Reading weights
# ------------------------------------------------------------------------------------------------
def safetensors_header(path: Path) -> Dict[str, Any]:
    """The JSON header of a .safetensors file; HFFolderError if the file is cut short anywhere.

    Format: 8 bytes little-endian header length n, n bytes of JSON {name: {dtype, shape,
    data_offsets: [begin, end]}}, then the data; offsets count from the end of the header.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise HFFolderError(f"{path}: truncated ({size} bytes, not even a safetensors header)")
        (header_length,) = struct.unpack("<Q", prefix)
        if 8 + header_length > size:
            raise HFFolderError(f"{path}: truncated (header of {header_length} bytes, file of {size})")
        try:
            header = json.loads(f.read(header_length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise HFFolderError(f"{path}: not a safetensors file (unreadable header)") from None
    tensors = {name: info for name, info in header.items() if name != "__metadata__"}
    data_end = max((info["data_offsets"][1] for info in tensors.values()), default=0)
    expected = 8 + header_length + data_end
    if size < expected:
        raise HFFolderError(f"{path}: truncated ({size} bytes, its header describes {expected})")
    return tensors


def weight_files(folder: PathLike) -> Dict[str, str]:
    """{tensor name: file name} of a Hugging Face folder, from its index or its single file.

    Checks that every file exists and is complete and that each file holds the tensors the index
    assigns to it.
    """
    folder = Path(folder)
    index_path = folder / WEIGHTS_INDEX_FILE
    if index_path.is_file():
        try:
            weight_map: Dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError):
            raise HFFolderError(f"{index_path}: not a safetensors index (no weight_map)") from None
    elif (folder / SINGLE_WEIGHTS_FILE).is_file():
        weight_map = {name: SINGLE_WEIGHTS_FILE for name in safetensors_header(folder / SINGLE_WEIGHTS_FILE)}
    else:
        present = sorted(p.name for p in folder.glob("*")) if folder.is_dir() else []
        raise HFFolderError(f"{folder}: no {SINGLE_WEIGHTS_FILE} and no {WEIGHTS_INDEX_FILE} "
                            f"(only safetensors weights are supported; the folder holds {present})")
    for file_name in sorted(set(weight_map.values())):
        path = folder / file_name
        if not path.is_file():
            raise HFFolderError(f"{folder}: weight file {file_name} named in {WEIGHTS_INDEX_FILE} is missing")
        held = safetensors_header(path)
        absent = [n for n, f in weight_map.items() if f == file_name and n not in held]
        if absent:
            raise HFFolderError(f"{path}: lacks {absent[:3]} that {WEIGHTS_INDEX_FILE} places there")
    return weight_map


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


class HFWeights(Mapping[str, torch.Tensor]):
    """The weights of a Hugging Face folder as a lazy mapping: a tensor is read when it is asked for.

    `load_hf_state_dict_into_model` takes it in place of a state dict; each rank then reads only
    the tensors of its own stage, one at a time.
    """

    def __init__(self, folder: PathLike):
        self.folder = Path(folder)
        self._file_of = weight_files(self.folder)
        self._open: Dict[str, Any] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        file_name = self._file_of[name]  # KeyError for an unknown name, as a dict would
        if file_name not in self._open:
            self._open[file_name] = safe_open(str(self.folder / file_name), framework="pt")
        return self._open[file_name].get_tensor(name)

    def dtype_of(self, name: str) -> torch.dtype:
        """The stored dtype of one tensor, from the file's header (nothing is read)."""
        file_name = self._file_of[name]
        if file_name not in self._open:
            from safetensors import safe_open

            self._open[file_name] = safe_open(str(self.folder / file_name), framework="pt")
        return _SAFETENSORS_DTYPES[self._open[file_name].get_slice(name).get_dtype()]

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


def expected_hf_tensor_names(arch: Architecture) -> List[str]:
    """The HF tensors a model of `arch` is made of (what conversion needs), in HF order."""
    from hacpo_megatron.checkpoint.hf_mapping import EMBEDDING, FINAL_NORM, layer_tensor_maps

    names = list(EMBEDDING.hf)
    for i in range(arch.num_layers):
        for tensor_map in layer_tensor_maps(arch):
            names += [f"model.layers.{i}.{n}" for n in tensor_map.hf]
    names += list(FINAL_NORM.hf)
    if not arch.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def check_hf_weights_complete(folder: PathLike, arch: Architecture) -> HFWeights:
    """The folder's weights, after checking that every tensor `arch` needs is there."""
    weights = HFWeights(folder)
    missing = [n for n in expected_hf_tensor_names(arch) if n not in weights]
    if missing:
        raise HFFolderError(f"{folder}: the weights lack {len(missing)} tensor(s) a {arch.hf_architecture} "
                            f"of this config needs, e.g. {missing[:3]}")
    return weights


# ------------------------------------------------------------------------------------------------
# Writing weights
# ------------------------------------------------------------------------------------------------
def _shard_file_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def write_hf_weights(
    tensors: Iterable[Tuple[str, torch.Tensor]], folder: PathLike, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> Dict[str, str]:
    """Write (name, tensor) pairs as safetensors shards of at most `max_shard_bytes` (a single larger
    tensor gets a shard of its own), with `model.safetensors.index.json` when there is more than one
    shard (transformers' own layout). Returns {name: file name}.

    Memory: one shard. Shards are written under provisional names and renamed once their number
    is known (the names say "-of-N").
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    provisional: List[Path] = []
    file_of: Dict[str, int] = {}
    bucket: Dict[str, torch.Tensor] = {}
    bucket_bytes = 0
    total_bytes = 0

    def flush() -> None:
        nonlocal bucket, bucket_bytes
        if bucket:
            path = folder / f"partial-{len(provisional):05d}.safetensors"
            save_file(bucket, str(path), metadata={"format": "pt"})  # "pt": transformers checks it
            provisional.append(path)
            bucket, bucket_bytes = {}, 0

    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if bucket and bucket_bytes + size > max_shard_bytes:
            flush()
        bucket[name] = tensor.detach().cpu().contiguous()
        file_of[name] = len(provisional)
        bucket_bytes += size
        total_bytes += size
    flush()

    count = len(provisional)
    final_names = [SINGLE_WEIGHTS_FILE] if count == 1 else [_shard_file_name(i + 1, count) for i in range(count)]
    for path, final in zip(provisional, final_names):
        os.replace(path, folder / final)
    weight_map = {name: final_names[i] for name, i in file_of.items()}
    if count > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (folder / WEIGHTS_INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return weight_map


def parse_size(text: Union[str, int]) -> int:
    """'5GB', '500MB', '2MiB', '1024' -> bytes (transformers' `max_shard_size` spellings)."""
    if isinstance(text, int):
        return text
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    upper = text.strip().upper()
    for unit, factor in units.items():
        if upper.endswith(unit):
            return int(float(upper[: -len(unit)]) * factor)
    return int(upper)


# ------------------------------------------------------------------------------------------------
# Tokenizer and side files
# ------------------------------------------------------------------------------------------------
def copy_tokenizer_files(source: PathLike, target: PathLike) -> List[str]:
    """Copy the tokenizer files (TOKENIZER_FILES) that `source` has into `target`; their names."""
    source, target = Path(source), Path(target)
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / name, target / name)
            copied.append(name)
    return copied


def has_tokenizer(folder: PathLike) -> bool:
    return any((Path(folder) / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def fsync_tree(folder: PathLike) -> None:
    """Flush every file under `folder`, and the folders themselves, to stable storage.

    Called before a finished folder is renamed into place: after a power loss the rename must not
    survive while the files it points to do not.
    """
    for root, _dirs, files in os.walk(folder):
        for name in files:
            _fsync_path(os.path.join(root, name), os.O_RDONLY)
        _fsync_path(root, os.O_RDONLY)


def _fsync_path(path: str, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomically(path: PathLike, text: str) -> None:
    """Write `text` to `path` so that a reader sees either the old content or the new, never half."""
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    _fsync_path(str(path.parent), os.O_RDONLY)


def publish_folder(partial: PathLike, target: PathLike) -> None:
    """Flush a finished `partial` folder and rename it to `target` (new or empty, checked before work),
    so an interrupted conversion never looks finished."""
    fsync_tree(partial)
    target = Path(target)
    if target.exists():
        target.rmdir()  # empty: check_empty_target ran before any work
    os.replace(partial, target)


def check_empty_target(folder: PathLike) -> None:
    """A conversion writes into a new or empty folder, never over an existing model."""
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise FileExistsError(f"{folder}: target exists and is not an empty folder; choose a new one")
