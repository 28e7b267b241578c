"""Where a run's metrics go besides metrics.jsonl: TensorBoard, Weights & Biases, MLflow (`logging.trackers`).

metrics.jsonl stays the source of truth and is always written. Every tracker gets the same numbers, named
"<agent>/<metric>" so that n agents' curves sit side by side, through three calls:

    tracker = open_tracker("mlflow", settings)
    tracker.log(step, {"qwen3-tiny/reward_mean": 0.41, ...})     # finite numbers only
    tracker.finish(artifacts=[summary.md, curves.png, ...], failed=False)

Resume: each tracker's run id is kept in run_info.json (key "trackers"), and `--resume` continues that tracked
run instead of starting a new one (W&B by id with resume="allow", MLflow by run id). Steps a crash made the run
redo are logged again: TensorBoard drops its events from the resumed step on (purge_step); MLflow keeps both
values of such a step in a metric's history; W&B's server keeps the first (its steps only go forward).

W&B runs offline unless WANDB_MODE says otherwise: its files go to RUN/wandb/offline-run-*/, and
`wandb sync RUN/wandb/offline-run-*` uploads them later (a machine without network can still track).
MLflow writes to a SQLite store in the run folder unless logging.mlflow_tracking_uri names another store
or server; `mlflow ui --backend-store-uri sqlite:///RUN/mlflow.db` shows it (the UI needs the full `mlflow`
package; the extra installs the client, `mlflow-skinny`, and SQLAlchemy for the store).
"""
from __future__ import annotations

import importlib.util
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

TRACKERS = ("tensorboard", "wandb", "mlflow")
TENSORBOARD_DIR = "tensorboard"
MLFLOW_DB = "mlflow.db"
MLFLOW_ARTIFACTS_DIR = "mlflow_artifacts"
# The Python modules each tracker needs, and how to get them (setup.py's extras).
REQUIRED_MODULES = {"tensorboard": ("tensorboard",), "wandb": ("wandb",), "mlflow": ("mlflow", "sqlalchemy")}
INSTALL_LINES = {"tensorboard": "pip install tensorboard", "wandb": "pip install '.[wandb]'",
                 "mlflow": "pip install '.[mlflow]'"}


def tracker_install_problems(names: Sequence[str]) -> List[str]:
    """One line per tracker whose package is missing, with its install line (preflight: before any work)."""
    problems = []
    for name in names:
        missing = [module for module in REQUIRED_MODULES.get(name, ()) if importlib.util.find_spec(module) is None]
        if missing:
            problems.append(f"tracker {name!r} needs {', '.join(missing)}, not installed here: {INSTALL_LINES[name]}")
    return problems


@dataclass
class TrackerSettings:
    output_dir: Path
    run_name: str
    project: str                                  # W&B project and MLflow experiment
    params: Mapping[str, Any] = field(default_factory=dict)   # the resolved config, "section.key" -> value
    start_step: int = 0                           # > 0 on resume: the first step this process logs
    run_id: Optional[str] = None                  # the tracked run to continue (run_info.json), None: a new one
    mlflow_tracking_uri: Optional[str] = None     # None: sqlite:///RUN/mlflow.db


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, settings: TrackerSettings):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops events of steps >= start_step left by the interrupted run, as metrics.jsonl is truncated
        self._writer = SummaryWriter(log_dir=str(settings.output_dir / TENSORBOARD_DIR),
                                     purge_step=settings.start_step if settings.start_step > 0 else None)
        self.run_id = None  # the folder is the run

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)

    def finish(self, artifacts: Sequence[Path], failed: bool) -> None:
        self._writer.flush()
        self._writer.close()


class WandbTracker:
    name = "wandb"

    def __init__(self, settings: TrackerSettings):
        import wandb

        self._wandb = wandb
        self._run = wandb.init(
            project=settings.project, name=settings.run_name, id=settings.run_id, resume="allow",
            dir=str(settings.output_dir), mode=os.environ.get("WANDB_MODE", "offline"), config=dict(settings.params),
            # the run's own console stays as it is: W&B neither captures nor prints into it
            settings=wandb.Settings(console="off", quiet=True, silent=True))
        self.run_id = self._run.id

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def finish(self, artifacts: Sequence[Path], failed: bool) -> None:
        files = [path for path in artifacts if Path(path).is_file()]
        if files:
            artifact = self._wandb.Artifact(f"run-outputs-{self.run_id}", type="run-outputs")
            for path in files:
                artifact.add_file(str(path))
            self._run.log_artifact(artifact)
        self._run.finish(exit_code=1 if failed else 0)
        # finish() only tells W&B's service process that the run is over; the service writes the run file out
        # on its own time. teardown() waits for the service to end, so the file is whole when the run returns
        # (a `wandb sync` or a reader right after it sees every record) and no service outlives the run.
        self._wandb.teardown(exit_code=1 if failed else 0)


class MlflowTracker:
    name = "mlflow"
    BATCH = 1000  # MLflow's limit of metrics per log_batch call; params: 100

    def __init__(self, settings: TrackerSettings):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        own_store = settings.mlflow_tracking_uri is None
        uri = f"sqlite:///{(settings.output_dir / MLFLOW_DB).resolve()}" if own_store else settings.mlflow_tracking_uri
        self._client = MlflowClient(tracking_uri=uri)
        experiment = self._client.get_experiment_by_name(settings.project)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(
            settings.project,
            artifact_location=(settings.output_dir / MLFLOW_ARTIFACTS_DIR).resolve().as_uri() if own_store else None)
        if settings.run_id and self._run_exists(settings.run_id):
            self.run_id = settings.run_id
            self._client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self._client.create_run(experiment_id, run_name=settings.run_name).info.run_id
            params = [Param(mlflow_key(key), str(value)[:6000]) for key, value in settings.params.items()]
            for start in range(0, len(params), 100):
                self._client.log_batch(self.run_id, params=params[start:start + 100])

    def _run_exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self._client.get_run(run_id)
            return True
        except MlflowException:
            return False

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        rows = [Metric(mlflow_key(key), float(value), now_ms, step) for key, value in metrics.items()]
        for start in range(0, len(rows), self.BATCH):
            self._client.log_batch(self.run_id, metrics=rows[start:start + self.BATCH])

    def finish(self, artifacts: Sequence[Path], failed: bool) -> None:
        for path in artifacts:
            if Path(path).is_file():
                self._client.log_artifact(self.run_id, str(path))
        self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


_UNSAFE = re.compile(r"[^\w\-. /]")


def mlflow_key(key: str) -> str:
    """MLflow names may hold letters, digits, '_', '-', '.', ' ' and '/': anything else becomes '_'."""
    return _UNSAFE.sub("_", key)


TRACKER_CLASSES = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}


def open_tracker(name: str, settings: TrackerSettings):
    if name not in TRACKER_CLASSES:
        raise ValueError(f"unknown tracker {name!r}; choose from {list(TRACKERS)}")
    return TRACKER_CLASSES[name](settings)


def flat_params(config: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
    """A nested config dict as "section.key" -> value; lists by index ("agents.0.name"), as --set names them."""
    flat: Dict[str, Any] = {}
    items = enumerate(config) if isinstance(config, list) else config.items()
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, (Mapping, list)) and value:
            flat.update(flat_params(value, f"{name}."))
        else:
            flat[name] = value
    return flat
