"""train.agents_take_turns: agents' updates one after another across ranks, or side by side."""
import json

import pytest

from tests.models.torchrun import REPO, run_torchrun

WORKER = REPO / "tests" / "orchestrator" / "workers" / "turns_worker.py"


@pytest.fixture(scope="module")
def updates(tmp_path_factory):
    """{take_turns: [(agent, start, end, rank)] in start order} from two ranks hosting three agents."""
    out = tmp_path_factory.mktemp("turns")
    run_torchrun(WORKER, 2, str(out), timeout=120)
    merged = {"true": [], "false": []}
    for rank in (0, 1):
        for mode, rows in json.loads((out / f"rank{rank}.json").read_text()).items():
            merged[mode] += [(k, start, end, rank) for k, start, end in rows]
    return {mode: sorted(rows, key=lambda row: row[1]) for mode, rows in merged.items()}


def test_each_rank_trains_exactly_its_learners_in_agent_order(updates):
    for rows in updates.values():
        assert sorted((rank, k) for k, _, _, rank in rows) == [(0, 0), (0, 2), (1, 1)]
        rank0 = [k for k, _, _, rank in rows if rank == 0]
        assert rank0 == [0, 2]


def test_with_turns_no_two_updates_overlap_and_agents_go_in_order(updates):
    rows = updates["true"]
    assert [k for k, *_ in rows] == [0, 1, 2]
    for (_, _, end, _), (_, start, _, _) in zip(rows, rows[1:]):
        assert end <= start  # agent k+1 starts after agent k ended, on another rank too


def test_without_turns_agents_on_different_ranks_update_at_once(updates):
    spans = {k: (start, end) for k, start, end, _ in updates["false"]}
    assert spans[1][0] < spans[0][1] and spans[0][0] < spans[1][1]  # agents 0 and 1 overlap in time
