"""Placement and node-loss reports (orchestrator/placement.py) on the layouts of the four-agent example.
The same code across two real hosts: tests/e2e/test_multi_node.py."""
import pytest

from hacpo_megatron.config import load_config
from hacpo_megatron.orchestrator.placement import (
    NodeWatch, RayNode, engine_nodes, lost_node_message, nodes_named_in, pinned_to, ranks_by_node,
)
from hacpo_megatron.parallel.groups import AgentParallel
from hacpo_megatron.parallel.layout import agent_rank_ranges
from tests.e2e.test_hacpo_run import REPO

HOST0 = RayNode("a" * 56, "10.77.0.1")
HOST1 = RayNode("b" * 56, "10.77.0.2")
RANK_NODES = [HOST0, HOST0, HOST1, HOST1]


def layouts(rank: int = 0):
    """The four-agent example's agents as rank `rank` sees them (no process groups needed)."""
    agents = load_config(str(REPO / "configs" / "examples" / "four_agents_two_hosts_cpu.yaml")).agents
    return [AgentParallel(name=a.name, ranks=tuple(r), tp_size=a.parallel.tensor, pp_size=a.parallel.pipeline,
                          dp_size=a.parallel.data, rank=rank, pg_collection=None)
            for a, r in zip(agents, agent_rank_ranges(agents))]


def test_each_engine_goes_to_the_node_of_its_engine_rank():
    # llama-tiny TP=2 on ranks 0-1 -> rank 0; smol-llama rank 0; qwen3-tiny PP=2 on ranks 1-2 -> the
    # last stage, rank 2 (host 1); qwen3-gpt2 TP=2 on ranks 2-3 -> rank 2
    assert engine_nodes(layouts(), RANK_NODES) == [HOST0, HOST0, HOST1, HOST1]


def test_affinity_is_hard():
    strategy = pinned_to(HOST1)["scheduling_strategy"]
    assert strategy.node_id == HOST1.node_id and strategy.soft is False


def test_ranks_by_node_keeps_the_order_of_first_ranks():
    assert ranks_by_node([HOST1, HOST0, HOST1]) == {HOST1: [0, 2], HOST0: [1]}


def test_an_address_matches_only_whole():
    nodes = [RayNode("c", "10.0.0.1"), RayNode("d", "10.0.0.12")]
    assert nodes_named_in("Connection closed by peer [10.0.0.12]:1680", nodes) == [nodes[1]]
    assert nodes_named_in("peer 10.0.0.1:80 and 110.0.0.1", nodes) == [nodes[0]]


def watch(rank: int) -> NodeWatch:
    names = [p.name for p in layouts(rank)]
    return NodeWatch(RANK_NODES, dict(zip(names, engine_nodes(layouts(rank), RANK_NODES))), rank)


def test_an_error_naming_another_node_is_explained_with_its_ranks_and_engines():
    try:
        try:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.77.0.2]:1680")
        except RuntimeError as gloo:
            raise ValueError("broadcast failed") from gloo  # the address is in the cause only
    except ValueError as error:
        lines = watch(rank=0).explain(error)
    assert len(lines) == 1
    assert "node 10.77.0.2" in lines[0] and "ranks 2, 3" in lines[0] and "--resume" in lines[0]
    assert "rollout engines of qwen3-tiny, qwen3-gpt2" in lines[0]
    # a rank's own node is not "lost" because an error names it
    assert watch(rank=2).explain(RuntimeError("closed by peer [10.77.0.2]:1680")) == []


@pytest.mark.parametrize("table,dead", [
    ([{"NodeID": HOST0.node_id, "Alive": True}, {"NodeID": HOST1.node_id, "Alive": True}], []),
    ([{"NodeID": HOST0.node_id, "Alive": True},
      {"NodeID": HOST1.node_id, "Alive": False, "DeathReasonMessage": "health check failed"}],
     [(HOST1, "health check failed")]),
    ([{"NodeID": HOST0.node_id, "Alive": True}], [(HOST1, "not in Ray's node table")]),
])
def test_dead_nodes_of_the_job_are_those_ray_reports_dead_or_forgot(table, dead):
    assert watch(rank=0).dead_nodes(table) == dead


def test_the_lost_node_message_says_what_ran_there_and_how_to_go_on():
    message = lost_node_message(HOST1, [2, 3], ["qwen3-tiny"], "health check failed")
    assert message.startswith(f"node 10.77.0.2 (Ray node {'b' * 12}) is lost (health check failed): it ran ranks 2, 3 "
                              "and the rollout engines of qwen3-tiny")
    assert "--resume" in message
