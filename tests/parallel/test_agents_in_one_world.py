"""Three agents with different layouts share one 3-process torchrun world (agents_worker.py)."""
import json
from pathlib import Path

import pytest

from tests.models.torchrun import run_torchrun

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parents[1] / "models" / "workers" / "agents_worker.py"


@pytest.fixture(scope="module")
def reports(module_tmp):
    out = module_tmp("agents")
    run_torchrun(WORKER, 3, str(out), timeout=240)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]


def test_each_rank_belongs_to_the_agents_of_its_layout(reports):
    assert [sorted(r["agents"]) for r in reports] == [["A"], ["A", "C"], ["B", "C"]]


def test_groups_stay_inside_their_agent(reports):
    a0, a1 = reports[0]["agents"]["A"], reports[1]["agents"]["A"]
    assert a0["tp_group"] == a1["tp_group"] == [0, 1] and (a0["tp_rank"], a1["tp_rank"]) == (0, 1)
    assert reports[2]["agents"]["B"]["tp_group"] == [2]
    for rank in (1, 2):
        c = reports[rank]["agents"]["C"]
        assert c["dp_group"] == [1, 2] and c["tp_group"] == [rank] and c["dp_rank"] == rank - 1
        assert c["dp_sum_of_ranks"] == 3.0  # rank 0 (agent A only) never joins C's reduction


@pytest.mark.parametrize("rank,agent", [(0, "A"), (1, "A"), (2, "B"), (1, "C"), (2, "C")])
def test_logprobs_match_single_process_reference(reports, rank, agent):
    info = reports[rank]["agents"][agent]
    assert info["max_diff_vs_hf"] <= 1e-5
    assert info["sums_diff"] <= 1e-4


def test_data_parallel_replicas_split_the_batch(reports):
    assert reports[1]["agents"]["C"]["num_sequences"] + reports[2]["agents"]["C"]["num_sequences"] == 5
