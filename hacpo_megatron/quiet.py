"""Third-party notices that tell a user of this project nothing, hidden in one place.

`install()` runs at `import hacpo_megatron` (hacpo_megatron/__init__.py), before Megatron,
transformers or Ray are imported, so every process that imports the package hides them: the
torchrun ranks (the entry imports the package first), the Ray actors (their classes live in the
package, so a worker imports it before it builds one) and the tools. Everything else is shown,
our own messages always. `HACPO_SHOW_ALL_WARNINGS=1` shows these too (for a bug report upstream).

Each entry of `HIDDEN` names where the notice comes from and a regex its text starts with
(`re.match`, case-insensitive for `warnings`): kind "warning" is a `warnings.warn` whose calling
module matches `source` (a regex on the module name), kind "log" a `logging` record on the logger
named `source` (Megatron logs through `logging.getLogger(__name__)`; a filter on that logger drops
the record before any handler sees it). `cpu_torch_only` entries are hidden only with a CPU build
of torch, where they can never be acted on; on a CUDA build they stay visible.
"""
from __future__ import annotations

import logging
import os
import re
import warnings
from typing import List, NamedTuple, Optional, Tuple

SHOW_ALL_ENV = "HACPO_SHOW_ALL_WARNINGS"


class Hidden(NamedTuple):
    kind: str          # "warning" (warnings.warn) or "log" (logging)
    source: str        # module-name regex (warning) or exact logger name (log)
    message: str       # regex the message starts with
    cpu_torch_only: bool = False


HIDDEN: Tuple[Hidden, ...] = (
    # Megatron's optimizer, FSDP mixed precision and grad clipping say, once per process, that they
    # use torch's implementations: Transformer Engine and NVIDIA Apex cannot be installed next to a
    # CPU build of torch (docs: NOTES-environment), and these fallbacks are the code this project's
    # CPU tests run. Shown on CUDA builds, where installing TE is the user's fix.
    Hidden("warning", r"megatron\.core\.", r"Transformer Engine and Apex are not installed", True),
    # Same cause: Megatron's local layer spec normalises with torch's RMSNorm/LayerNorm when Apex is
    # missing (printed per model built). Shown on CUDA builds.
    Hidden("warning", r"megatron\.core\.", r"Apex is not installed\. Falling back to Torch Norm", True),
    # Megatron 0.19's own default `cuda_graph_modules="full"` triggers its own deprecation notice in
    # every TransformerConfig, whatever the caller sets; CUDA graphs are off here (cuda_graph_impl
    # "none"), so nothing is captured and there is nothing to migrate.
    Hidden("warning", r"megatron\.core\.transformer\.transformer_config",
           r"full scope is deprecated\. Use empty cuda_graph_modules"),
    # Megatron marks its multimodal MIMO config experimental when the module is imported; it is
    # pulled in by Megatron's own imports, this project never uses MIMO models.
    Hidden("warning", r"megatron\.core\.models\.mimo\.",
           r"MimoModelConfig is experimental and still under active development"),
    # Printed for every GPTModel built: Megatron steers new work to HybridModel. This project builds
    # GPTModel on purpose with a pinned megatron-core (README, docs); the user can do nothing about it.
    Hidden("log", "megatron.core.models.gpt.gpt_model", r"GPTModel IS DEPRECATED"),
    # Printed at the first checkpoint save: Megatron's *synchronous* save runs through its own
    # async path internally (`save()` calls `async_save(..., async_strategy="mcore")`); this project
    # never asks for async saves, so the advice to switch to NVRx does not apply.
    Hidden("log", "megatron.core.dist_checkpointing.strategies.torch", r"MCore's async save is deprecated"),
    # The next three are printed when a checkpoint is loaded (`--resume`, tools): torch's distributed
    # checkpoint addressing its caller, Megatron's load strategy, which passes `no_dist=True` on
    # purpose (each rank reads the shards it needs, no collective)...
    Hidden("warning", r"torch\.distributed\.checkpoint\.",
           r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent is to load in a "
           r"single process"),
    # ... calls `load(state_dict, reader)` positionally (torch maps it to the new order itself) ...
    Hidden("warning", r"torch\.distributed\.checkpoint\.", r"The argument order of load has been changed"),
    # ... and converts Megatron's shards through torch's ShardedTensor, which torch deprecates in
    # favour of DTensor. Nothing for a user to change in any of the three.
    Hidden("warning", r"torch\.distributed\.checkpoint\.", r"Please use DTensor instead and we are deprecating "
           r"ShardedTensor"),
    # Each torchrun rank other than 0 joining the job's own local Ray (always on 127.0.0.1): one line
    # per rank about an internal connection. Joining a cluster given with --ray-address still says so.
    Hidden("log", "ray._private.worker", r"Connecting to existing Ray cluster at address: 127\.0\.0\.1:"),
    # Follows every connection; a failed connection raises with its own message, this says nothing.
    Hidden("log", "ray._private.worker", r"Connected to Ray cluster\.$"),
)


class _DropMessages(logging.Filter):
    """A logger filter dropping records whose message starts with one of the patterns."""

    def __init__(self, patterns):
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # a malformed record is not ours to judge
            return True
        return not any(p.match(text) for p in self.patterns)


_installed = False


def torch_is_cpu_build() -> bool:
    """True for a CPU build of torch (its version file says `cuda = None`), without importing torch
    (this runs at package import, e.g. in `python -m hacpo_megatron.config`, which needs no torch)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    version_file = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    try:
        with open(version_file, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return False
    return re.search(r"^cuda\s*(?::[^=]*)?=\s*None\s*$", text, re.M) is not None


def active_entries() -> Tuple[Hidden, ...]:
    """The entries that apply in this process (none with HACPO_SHOW_ALL_WARNINGS=1)."""
    if os.environ.get(SHOW_ALL_ENV, "") not in ("", "0"):
        return ()
    cpu = torch_is_cpu_build() if any(h.cpu_torch_only for h in HIDDEN) else False
    return tuple(h for h in HIDDEN if cpu or not h.cpu_torch_only)


def install(entries: Optional[Tuple[Hidden, ...]] = None) -> List[Tuple[logging.Logger, logging.Filter]]:
    """Hide the listed notices in this process (the default: `active_entries()`, once per process).
    With `entries` (tests) it installs exactly those. Returns the logger filters it added, so that a
    caller can remove them (`warnings` filters are undone by `warnings.catch_warnings()`)."""
    global _installed
    if entries is None:
        if _installed:
            return []
        _installed = True
        entries = active_entries()
    by_logger = {}
    for entry in entries:
        if entry.kind == "warning":
            warnings.filterwarnings("ignore", message=entry.message, module=entry.source)
        elif entry.kind == "log":
            by_logger.setdefault(entry.source, []).append(entry.message)
        else:
            raise ValueError(f"unknown kind {entry.kind!r} in hacpo_megatron.quiet.HIDDEN")
    added = []
    for name, patterns in by_logger.items():
        logger, drop = logging.getLogger(name), _DropMessages(patterns)
        logger.addFilter(drop)
        added.append((logger, drop))
    return added
