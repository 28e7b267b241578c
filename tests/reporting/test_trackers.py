"""Experiment trackers: what W&B and MLflow hold, read back through each library's own reader, equals metrics.jsonl.

The runs are RunReporter's (the same calls the training loop makes); a resumed reporter continues the same tracked
run. W&B runs offline (no network here): its run file is read with W&B's own record schema (wandb_internal_pb2).
(Both extras are installed by the set-up, tools/setup_env.sh: a missing one fails here, never skips.)
"""
import glob
import json
import struct
import time

import pytest

from hacpo_megatron.reporting import REQUIRED_KEYS, read_metrics, read_run_info, tracker_install_problems
from hacpo_megatron.reporting.trackers import flat_params, mlflow_key
from tests.reporting.test_reporting import AGENTS, STEPS, write_run

PARAMS = {"algorithm.name": "hacpo", "algorithm.alpha": 1.0, "agents.0.name": "qwen3-tiny", "run.seed": 7}


def expected_metrics(run_dir):
    """{(step, "<agent>/<metric>"): value} from metrics.jsonl: every number a tracker should hold."""
    out = {}
    for record in read_metrics(run_dir / "metrics.jsonl"):
        for key, value in record.items():
            if key in ("step", "agent", "kind", "timestamp") or isinstance(value, bool) or value is None \
                    or isinstance(value, str):
                continue
            out[(record["step"], f"{record['agent']}/{key}")] = value
    return out


# ---------------------------------------------------------------------------------------------------- MLflow


def mlflow_client(run_dir):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")


def mlflow_values(client, run_id, keys):
    """{(step, key): value} from the metric histories; the last value logged at a step wins (as after a resume)."""
    out = {}
    for key in keys:
        for metric in sorted(client.get_metric_history(run_id, mlflow_key(key)), key=lambda m: m.timestamp):
            out[(metric.step, key)] = metric.value
    return out


def test_mlflow_run_holds_every_metric_param_and_artifact(tmp_path):
    write_run(tmp_path, trackers=("mlflow",), plots=True, nan_at=2, project="pair-study", run_name="cell-1",
              params=PARAMS)
    client = mlflow_client(tmp_path)
    experiment = client.get_experiment_by_name("pair-study")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == read_run_info(tmp_path)["trackers"]["mlflow"]
    assert run.info.run_name == "cell-1" and run.info.status == "FINISHED"
    assert run.data.params == {key: str(value) for key, value in PARAMS.items()}
    expected = expected_metrics(tmp_path)
    assert len({key for _, key in expected}) == 2 * (len(REQUIRED_KEYS) - 2 + 1)  # both agents, every metric + eval
    assert mlflow_values(client, run.info.run_id, {key for _, key in expected}) == pytest.approx(expected)
    assert (2, "qwen3-tiny/loss") not in expected  # NaN is written as null and sent nowhere
    artifacts = {item.path for item in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"summary.md", "curves.png", "eval_accuracy.png"}


def test_mlflow_resume_continues_the_same_run(tmp_path):
    write_run(tmp_path, trackers=("mlflow",), params=PARAMS)  # steps 0-5
    first_id = read_run_info(tmp_path)["trackers"]["mlflow"]
    # a resume from a checkpoint of step 4 redoes steps 4-5 (here with other rewards, to tell them apart)
    write_run(tmp_path, trackers=("mlflow",), steps=range(4, STEPS), start_step=4, evals={}, reward_offset=1.0,
              params=PARAMS)
    client = mlflow_client(tmp_path)
    runs = client.search_runs([client.get_experiment_by_name("hacpo").experiment_id])
    assert [r.info.run_id for r in runs] == [first_id] and runs[0].info.status == "FINISHED"
    assert read_run_info(tmp_path)["trackers"]["mlflow"] == first_id
    # what metrics.jsonl holds now (steps 0-3 from the first process, 4-5 redone) is what the run's latest values say
    expected = expected_metrics(tmp_path)
    found = mlflow_values(client, first_id, {key for _, key in expected})
    assert {k: found[k] for k in expected} == pytest.approx(expected)
    assert expected[(5, "llama-tiny/reward_mean")] > 1.0
    # MLflow cannot forget: a value the first process logged for a redone step and the resume did not log again
    # (here step 4's evaluation) stays in the history; metrics.jsonl dropped it
    assert set(found) - set(expected) == {(4, f"{agent}/eval/accuracy") for agent in AGENTS}


def test_a_fresh_run_in_the_same_folder_starts_a_new_tracked_run(tmp_path):
    write_run(tmp_path, trackers=("mlflow",))
    first_id = read_run_info(tmp_path)["trackers"]["mlflow"]
    write_run(tmp_path, trackers=("mlflow",))  # start_step 0: not a resume
    assert read_run_info(tmp_path)["trackers"]["mlflow"] != first_id


# ---------------------------------------------------------------------------------------------------- W&B
def wandb_records(run_file):
    """Every record of an offline W&B run file, parsed with W&B's own protobuf schema.

    The file is W&B's 7-byte header (":W&B", magic, version) and then LevelDB's log format: 32 KiB blocks of chunks,
    each a 4-byte checksum, a 2-byte length, a 1-byte type (1 whole, 2 first, 3 middle, 4 last); a block's tail too
    short for a chunk header is padding.
    """
    from wandb.proto import wandb_internal_pb2

    data = open(run_file, "rb").read()
    assert data[:4] == b":W&B"
    position, block, pending, records = 7, 32768, b"", []
    while position + 7 <= len(data):
        if block - position % block < 7:
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
        if kind == 0 and length == 0:
            break  # zero padding at the end
    return records


def wandb_history(records):
    """{(step, key): value} from the history records; the last value of a step wins."""
    out = {}
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        row = {("/".join(item.nested_key) or item.key): json.loads(item.value_json) for item in record.history.item}
        step = row.pop("_step")
        for key, value in row.items():
            if not key.startswith("_"):
                out[(step, key)] = value
    return out




def wandb_service_processes():
    import psutil

    return [child for child in psutil.Process().children(recursive=True) if "wandb" in child.name().lower()]


def test_wandb_offline_run_holds_every_metric_and_the_config(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default
    write_run(tmp_path, trackers=("wandb",), plots=True, params=PARAMS, run_name="cell-1")
    # the reporter's close waited for W&B's service to write the file and end (CI once read it before it had)
    assert wandb_service_processes() == []
    run_id = read_run_info(tmp_path)["trackers"]["wandb"]
    (run_file,) = glob.glob(str(tmp_path / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
    records = wandb_records(run_file)
    kinds = {record.WhichOneof("record_type") for record in records}
    assert {"run", "history", "artifact", "exit"} <= kinds
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.run_id == run_id and run.display_name == "cell-1" and run.project == "hacpo"
    config = {item.key: json.loads(item.value_json) for item in run.config.update if not item.key.startswith("_")}
    assert config == PARAMS
    assert wandb_history(records) == pytest.approx(expected_metrics(tmp_path))
    (artifact,) = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    assert {entry.path for entry in artifact.manifest.contents} == {"summary.md", "curves.png", "eval_accuracy.png"}


def test_wandb_resume_writes_to_the_same_run_id(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    write_run(tmp_path, trackers=("wandb",))
    run_id = read_run_info(tmp_path)["trackers"]["wandb"]
    time.sleep(1.1)  # W&B names an offline run's folder by the second it starts: a real resume is never as quick
    write_run(tmp_path, trackers=("wandb",), steps=range(4, STEPS), start_step=4, evals={}, reward_offset=1.0)
    files = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) == 2 and all(f.endswith(f"run-{run_id}.wandb") for f in files)  # `wandb sync` joins them
    second = wandb_history(wandb_records(files[-1]))
    assert {step for step, _ in second} == {4, 5}
    assert second[(5, "llama-tiny/reward_mean")] == pytest.approx(
        expected_metrics(tmp_path)[(5, "llama-tiny/reward_mean")])


# ---------------------------------------------------------------------------------------------------- set-up
def test_a_missing_tracker_package_is_named_with_its_install_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert tracker_install_problems(["tensorboard", "wandb", "mlflow"]) == [
        "tracker 'wandb' needs wandb, not installed here: pip install '.[wandb]'"]


def test_flat_params_names_keys_as_set_does():
    assert flat_params({"run": {"seed": 1}, "agents": [{"name": "a", "parallel": {"tensor": 2}}], "empty": [],
                        "reward": {"range": [0, 1]}}) == {
        "run.seed": 1, "agents.0.name": "a", "agents.0.parallel.tensor": 2, "empty": [], "reward.range.0": 0,
        "reward.range.1": 1}
    assert mlflow_key("qwen3-tiny/reward/timeout:2") == "qwen3-tiny/reward/timeout_2"
