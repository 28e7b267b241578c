"""Fixtures shared by the end-to-end tests: one warm-up cache and one uninterrupted reference run."""
import pytest

from tests.e2e.test_hacpo_run import run, small_config


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """The warm-up cache of the session's runs. Under xdist each worker has its own (the first run of each
    trains it): the end-to-end files of two workers start together, so a shared one would be trained twice
    anyway, by two processes racing to put it in place."""
    return tmp_path_factory.mktemp("warmup-cache")


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, cache):
    """The small default run, 3 steps, a checkpoint after every step, nothing interrupted, every tracker on; its
    answers and rewards saved in ../rollouts (--save-rollouts, for the train_only replay)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    run(small_config(out.parent, cache, checkpoint={"save_every": 1},
                     logging={"trackers": ["tensorboard", "mlflow", "wandb"], "plots": True}), out,
        "--save-rollouts", str(out.parent / "rollouts"))
    return out
