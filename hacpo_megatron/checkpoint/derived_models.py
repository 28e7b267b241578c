"""Models this project makes from a known one by training it: the stronger state of a state pair.

The paper's easiest heterogeneity is one model at two post-training states (Qwen3-4B beside Qwen3-4B-Instruct).
Here the weaker state is SmolLM2-135M-Instruct as it ships and the stronger one the same model after GSPO on the
pair's task (configs/real/smollm2_gspo_state.yaml). `tools/make_state.py` trains it once and exports the chosen
steps into the model cache as Hugging Face folders; a config then names one like any known model
(`init_from: smollm2-135m-instruct-gspo8`). A name whose folder is missing or incomplete is a config error that
names the command that makes it: a run never trains it silently (it takes a quarter of an hour on 2 cores).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

from hacpo_megatron.checkpoint.gguf_sources import default_cache_dir
from hacpo_megatron.checkpoint.hf_io import HFFolderError, weight_files

RECORD_FILE = "derived_source.json"  # what made the folder (config, step, commit, held-out accuracy); written last


@dataclass(frozen=True)
class DerivedModel:
    base: str  # the known model it was trained from (same architecture and tokenizer)
    config: str  # the training run's config (repository path)
    agent: str  # the agent of that run whose weights it is
    step: int  # the run's checkpoint step

    @property
    def make_command(self) -> str:
        return f"python tools/make_state.py --config {self.config} --steps {self.step}"


STATE_CONFIG = "configs/real/smollm2_gspo_state.yaml"
STATE_PREFIX = "smollm2-135m-instruct-gspo"
DERIVED_MODELS: Dict[str, DerivedModel] = {
    f"{STATE_PREFIX}{step}": DerivedModel("smollm2-135m-instruct", STATE_CONFIG, "smollm2", step) for step in (4, 8, 12)
}


def derived_name(config: str, step: int) -> Optional[str]:
    """The known name of `config`'s step, if it is one."""
    return next((name for name, model in DERIVED_MODELS.items()
                 if model.config == config and model.step == step), None)


def resolve_derived_model(name: str, cache_dir: Optional[Path] = None) -> Path:
    """The Hugging Face folder of a derived model, complete (its record written last, every weight file as long
    as its header says); ValueError naming the command that makes it otherwise."""
    folder = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / name
    model = DERIVED_MODELS[name]
    if not (folder / RECORD_FILE).is_file():
        raise ValueError(f"{name} is made by training ({folder} has no complete export): run "
                         f"`{model.make_command}` once (docs/study.md, 'The state pair')")
    try:
        weight_files(folder)
    except HFFolderError as exc:
        raise ValueError(f"{name} in {folder} is damaged ({exc}): delete the folder and run "
                         f"`{model.make_command}` again") from None
    return folder


def read_record(folder: Path) -> dict:
    return json.loads((Path(folder) / RECORD_FILE).read_text())
