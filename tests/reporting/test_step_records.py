"""A step's records from its parts (reporting/step_records.py): pure functions, checked by hand."""
import math

import torch

from hacpo_megatron.reporting.metrics_file import REQUIRED_KEYS
from hacpo_megatron.reporting.step_records import mean_over_updates, step_records


def test_a_steps_figures_are_the_updates_mean_but_the_bound_the_last_and_the_largest_micro_batch_the_largest():
    updates = [{"loss": 1.0, "cross_clip_lower_bound": 0.8, "micro_batch_tokens_max": 30.0, "kl": float("nan")},
               {"loss": 3.0, "cross_clip_lower_bound": 0.825, "micro_batch_tokens_max": 50.0},
               {"loss": float("nan"), "cross_clip_lower_bound": 0.85, "micro_batch_tokens_max": 40.0}]
    out = mean_over_updates(updates)
    assert out["loss"] == 2.0  # the NaN of an update without rows left out
    assert out["cross_clip_lower_bound"] == 0.85 and out["micro_batch_tokens_max"] == 50.0
    assert math.isnan(out["kl"]) and out["num_updates"] == 3.0


def test_the_regime_figures_are_each_updates_own_rows_clipped_and_the_others_right_answers_let_through():
    updates = [{"num_own": 8.0, "own_clip_frac_lower": 0.0, "own_clip_frac_upper": 0.0, "num_cross": 8.0,
                "cross_positive_frac": 0.5, "cross_positive_inside_frac": 0.25},
               {"num_own": 8.0, "own_clip_frac_lower": 0.25, "own_clip_frac_upper": 0.125, "num_cross": 8.0,
                "cross_positive_frac": 0.0, "cross_positive_inside_frac": 0.0},
               {"num_own": 0.0, "num_cross": 8.0, "cross_positive_frac": 0.75, "cross_positive_inside_frac": 0.75}]
    out = mean_over_updates(updates)
    assert out["regime/own_clipped/u0"] == 0.0 and out["regime/own_clipped/u1"] == 0.375  # lower + upper
    assert "regime/own_clipped/u2" not in out  # no own rows in that update
    assert out["regime/right_through/u0"] == 0.5 and out["regime/right_through/u2"] == 1.0  # of the right ones
    assert "regime/right_through/u1" not in out  # no right answer among the others'


def test_each_agent_gets_its_parts_omega_from_the_others_and_the_shared_figures():
    rewards = torch.tensor([[[1.0, 0.0]], [[0.0, 0.0]], [[1.0, 1.0]]])
    omega = torch.tensor([[1.0, 2.0, 0.5], [0.5, 1.0, 0.25], [2.0, 4.0, 1.0]])
    records = step_records(7, ["a", "b", "c"], rewards, torch.tensor([0.5, 0.0, 1.0]), omega,
                           {"timeouts": 2, "note": "text"}, before_capability=[{"x": 1.0}, {}, {}],
                           after_capability=[{"loss": 0.1}, {"loss": 0.2}, {"loss": 0.3}],
                           shared={"time/train": 4.0}, started=0.0, untrained=False)
    a, b, c = records
    assert [r["agent"] for r in records] == ["a", "b", "c"] and {r["step"] for r in records} == {7}
    assert (a["reward_mean"], b["reward_mean"], c["reward_mean"]) == (0.5, 0.0, 1.0)
    assert a["x"] == 1.0 and "x" not in b and (a["loss"], c["loss"]) == (0.1, 0.3)
    assert a["omega_from/b"] == 0.5 and a["omega_from/c"] == 2.0 and "omega_from/a" not in a  # omega[j, k]
    assert c["omega_from/a"] == 0.5 and c["omega_from/b"] == 0.25
    assert a["reward/timeouts"] == 2.0 and "reward/note" not in a  # numbers only
    assert all(r["time/train"] == 4.0 and r["time/step"] > 0 for r in records)


def test_a_step_without_learners_reports_the_learners_keys_as_nan():
    records = step_records(1, ["a", "b"], torch.zeros(2, 1, 2), torch.zeros(2), torch.ones(2, 2), {},
                           before_capability=[{}, {}], after_capability=[{}, {}], shared={}, started=0.0,
                           untrained=True)
    assert all(math.isnan(records[0][key]) for key in ("loss", "grad_norm", "own_ratio_mean"))
    assert set(REQUIRED_KEYS) <= set(records[0])
