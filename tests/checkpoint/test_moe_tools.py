"""The conversion tools' --ep (issue 52, item 5), what one process checks: the processes a layout takes, a bad --ep
named before any process starts (not dividing the experts, on a dense model, below 1; in a run of several agents,
which one), the layout each tool hands its processes, and an EP rank's share of a
checkpoint as megatron names it (global expert indices, what lets a checkpoint load at another EP).

The tools at EP 2 in 2- and 4-process worlds: tests/checkpoint/test_moe_conversion.py (distributed).
"""
import json
from dataclasses import asdict

import pytest
import torch

from hacpo_megatron.checkpoint.format import CheckpointMetadata
from hacpo_megatron.checkpoint.tool_layout import ToolLayout, check_tool_layout
from hacpo_megatron.models.architectures import read_architecture
from hacpo_megatron.models.presets import PRESETS, layout_problems
from tests.checkpoint.workers.checkpoint_worker import load_tool
from tests.models import test_moe
from tests.models.test_moe import EXPERTS, random_hf_model, tiny_config

world = test_moe.world  # the fixture: one agent's groups in a gloo world of this process alone (module scope)
TOOLS = {name: load_tool(name) for name in ("convert_hf_to_megatron", "convert_megatron_to_hf", "compare_hf_megatron")}
MOE, DENSE = "Qwen3MoeForCausalLM", "Qwen3ForCausalLM"


def dense_config():
    return dict(PRESETS["tiny-qwen3"])


# ------------------------------------------------------------------------------------------------
# The layout: its processes, its check
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tp, pp, ep, data, processes, printed", [
    (1, 1, 1, 1, 1, "TP=1, PP=1"),
    (2, 2, 1, 1, 4, "TP=2, PP=2"),
    (1, 1, 2, 2, 2, "TP=1, PP=1, EP=2"),  # EP ranks are data-parallel replicas
    (2, 1, 2, 1, 2, "TP=2, PP=1, EP=2"),  # ... or TP ranks of one replica
    (1, 2, 2, 2, 4, "TP=1, PP=2, EP=2"),
    (2, 1, 4, 2, 4, "TP=2, PP=1, EP=4"),
    (4, 1, 2, 1, 4, "TP=4, PP=1, EP=2"),
    (1, 1, 8, 8, 8, "TP=1, PP=1, EP=8"),
])
def test_a_layout_takes_the_fewest_replicas_that_ep_divides(tp, pp, ep, data, processes, printed):
    from hacpo_megatron.parallel.groups import expert_grid_shape

    layout = ToolLayout(tp, pp, ep)
    assert (layout.data, layout.world_size, str(layout)) == (data, processes, printed)
    config = layout.parallel_config()
    assert (config.tensor, config.pipeline, config.data, config.expert, config.expert_tensor, config.first_rank) == (
        tp, pp, data, ep, 1, 0)
    assert expert_grid_shape(tp, data, pp, ep, 1)[1] == ep  # the groups take it (EP x ETP divides TP x DP)
    assert all((tp * d) % ep for d in range(1, data))  # no fewer replicas would do


def test_the_tools_take_a_mixture_of_experts_at_tp_where_training_does_not_yet():
    moe = read_architecture(tiny_config())
    for layout in (ToolLayout(2, 1, 2), ToolLayout(1, 2, 2), ToolLayout(2, 2, 1), ToolLayout(1, 1, 8)):
        check_tool_layout(moe, layout)
    assert set(layout_problems(moe.layout_shape, 2, 2, MOE, ep=2, dp=1)) == {"tensor"}  # training: PP > 1 trains


@pytest.mark.parametrize("config, layout, message", [
    (tiny_config, ToolLayout(expert=3), f"EP=3 must divide the {EXPERTS} experts of {MOE}"),
    (tiny_config, ToolLayout(expert=16), f"EP=16 must divide the {EXPERTS} experts of {MOE}"),
    (dense_config, ToolLayout(expert=2), f"--ep 2: {DENSE} is a dense model, it has no experts to split"),
    (tiny_config, ToolLayout(expert=0), "TP, PP and EP must be >= 1, got TP=1, PP=1, EP=0"),
    (tiny_config, ToolLayout(3, 1, 2), "TP=3 must divide the attention heads (4)"),
], ids=["ep_3", "ep_16", "dense", "ep_0", "tp_3"])
def test_a_bad_layout_is_named(config, layout, message):
    with pytest.raises(ValueError) as error:
        check_tool_layout(read_architecture(config()), layout)
    assert message in str(error.value), str(error.value)


def test_the_builder_takes_those_layouts_only_outside_training():
    from hacpo_megatron.models.build import check_layout

    class TwoRanks:  # what check_layout reads of an AgentParallel: TP 2 x EP 2 on one replica
        name, tp_size, pp_size, dp_size, ep_size, etp_size = "m", 2, 1, 1, 2, 1

    arch = read_architecture(tiny_config())
    check_layout(arch, TwoRanks(), training=False)
    with pytest.raises(ValueError, match="m: TP=2 with the mixture of experts .* not supported yet in training"):
        check_layout(arch, TwoRanks())


# ------------------------------------------------------------------------------------------------
# The tools: checked before any process starts; the layout their processes get
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folders(module_tmp):
    """A Qwen3-MoE HF folder with weights; a dense one with only its config (the layout check comes first); an agent
    checkpoint folder of each (what is read before any process starts: metadata, HF config, the dist files' names);
    a step folder holding both."""
    root = module_tmp("moe_tools")
    moe_hf, dense_hf = root / "moe_hf", root / "dense_hf"
    random_hf_model(tiny_config(), seed=1).save_pretrained(moe_hf)
    dense_hf.mkdir()
    (dense_hf / "config.json").write_text(json.dumps(dense_config()))
    step = root / "step"
    for name, hf_config in (("moe", tiny_config().to_dict()), ("dense", dense_config())):
        arch = read_architecture(hf_config)
        folder = step / name
        (folder / "dist_checkpoint").mkdir(parents=True)
        for dist_file in ("metadata.json", ".metadata"):
            (folder / "dist_checkpoint" / dist_file).write_text("{}")
        (folder / "hf_config.json").write_text(json.dumps(hf_config))
        metadata = CheckpointMetadata(hf_architecture=arch.hf_architecture, vocab_size=arch.vocab_size,
                                      padded_vocab_size=1024, tensor_parallel=1, pipeline_parallel=1,
                                      has_optimizer=False, agent_name=name)
        (folder / "metadata.json").write_text(json.dumps(asdict(metadata)))
    return {"moe_hf": moe_hf, "dense_hf": dense_hf, "moe": step / "moe", "dense": step / "dense", "step": step}


@pytest.fixture
def no_processes(monkeypatch):
    """The tools' run_collective replaced: it records (world size, ToolLayout), starts nothing and returns what
    the tool's work returns (a folder, {agent: folder}, a logit difference). No world to leave either."""
    calls = []
    results = {"_convert": "FOLDER", "_export": {}, "_compare": 0.0}

    def record(fn, *args, world_size, **kwargs):
        [layout] = [a for a in args if isinstance(a, ToolLayout)]
        calls.append((world_size, layout))
        return results[fn.__name__]

    for module in TOOLS.values():
        monkeypatch.setattr(module, "run_collective", record)
        monkeypatch.setattr(module, "finish", lambda: None)
    return calls


def tool_commands(folders, tmp_path):
    return {
        "convert_hf_to_megatron": ["--hf-path", folders["moe_hf"], "--save", tmp_path / "out"],
        "convert_megatron_to_hf": ["--load", folders["moe"], "--save", tmp_path / "out"],
        "compare_hf_megatron": ["--hf-path", folders["moe_hf"], "--megatron-path", folders["moe"]],
    }


@pytest.mark.parametrize("name", list(TOOLS))
@pytest.mark.parametrize("flags, processes, layout", [
    ((), 1, ToolLayout()), (("--ep", "2"), 2, ToolLayout(1, 1, 2)),
    (("--ep", "2", "--tp", "2"), 2, ToolLayout(2, 1, 2)), (("--ep", "4", "--pp", "2"), 8, ToolLayout(1, 2, 4)),
], ids=["ep1", "ep2", "tp2_ep2", "pp2_ep4"])
def test_each_tool_hands_its_processes_the_layout(folders, tmp_path, no_processes, capsys, name, flags, processes,
                                                  layout):
    try:
        TOOLS[name].main([str(a) for a in tool_commands(folders, tmp_path)[name]] + list(flags))
    except SystemExit as exit_:  # compare_hf_megatron: 0 within its tolerance
        assert exit_.code == 0
    assert no_processes == [(processes, layout)]
    printed = capsys.readouterr().out
    if name == "convert_hf_to_megatron":
        assert printed == f"saved Megatron checkpoint ({layout}) to FOLDER\n"
    elif name == "compare_hf_megatron":
        assert printed.startswith(f"max |logit difference| = 0.000e+00 ({layout}, float32); ")


@pytest.mark.parametrize("name", list(TOOLS))
@pytest.mark.parametrize("model, flags, message", [
    ("moe", ("--ep", "3"), f"EP=3 must divide the {EXPERTS} experts of {MOE}"),
    ("dense", ("--ep", "2"), f"--ep 2: {DENSE} is a dense model, it has no experts to split over expert-parallel "
                             "ranks (--ep is for mixture-of-experts models such as Qwen3-MoE); leave --ep at 1"),
    ("moe", ("--ep", "-1"), "TP, PP and EP must be >= 1, got TP=1, PP=1, EP=-1"),
], ids=["ep_3", "dense", "ep_below_1"])
def test_a_bad_ep_is_one_line_before_any_process_starts(folders, tmp_path, no_processes, capsys, name, model, flags,
                                                        message):
    command = tool_commands(folders, tmp_path)[name]
    if model == "dense":
        command = [folders["dense_hf"] if c == folders["moe_hf"] else folders["dense"] if c == folders["moe"] else c
                   for c in command]
    with pytest.raises(SystemExit) as exit_:
        TOOLS[name].main([str(a) for a in command] + list(flags))
    assert str(exit_.value) == f"{name}: error: {message}"
    assert no_processes == [] and not (tmp_path / "out").exists()


def test_a_runs_dense_agent_at_ep_2_is_named(folders, tmp_path, no_processes):
    with pytest.raises(ValueError) as error:
        TOOLS["convert_megatron_to_hf"].convert_megatron_to_hf(str(folders["step"]), str(tmp_path / "out"),
                                                               expert_parallel=2)
    assert str(error.value).startswith(f"agent 'dense' ({folders['dense']}): --ep 2: {DENSE} is a dense model")
    assert no_processes == []


# ------------------------------------------------------------------------------------------------
# What runs in this process
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ep_rank", [0, 1])
def test_an_ep_ranks_checkpoint_shards_are_its_global_experts(world, ep_rank):
    """What a save at EP 2 writes and a load at any EP reads: each expert weight a shard of one tensor per layer and
    projection over all 8 experts, at its global index (EP rank r: 4r .. 4r + 3), written by expert-DP replica 0
    (every EP rank writes its own)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from hacpo_megatron.checkpoint.megatron_io import agent_sharded_state_dict
    from hacpo_megatron.models.build import build_agent_model
    from tests.models.test_moe_expert_parallel import ep_rank_parallel

    parallel = ep_rank_parallel(world, ep_rank)
    agent = build_agent_model(tiny_config().to_dict(), parallel, seed=1, params_dtype=torch.float32)
    state = agent_sharded_state_dict(agent)["model"]
    apply_factories(state)  # fc1 [gate; up] becomes its two halves, as a save writes them
    experts = [s for s in nested_values(state) if isinstance(s, ShardedTensor) and ".mlp.experts." in s.key]
    indices = {}
    for shard in experts:
        # the layer axis (2 layers), then the expert axis (8 experts), then the weight's own
        assert shard.global_shape[:2] == (2, EXPERTS) and shard.prepend_axis_num == 2, shard
        indices.setdefault((shard.key, shard.global_offset[0]), []).append(shard.global_offset[1])
        assert shard.replica_id[-1] == 0  # expert-DP rank 0: every EP rank writes its own experts
    per_rank = EXPERTS // 2
    mine = list(range(ep_rank * per_rank, (ep_rank + 1) * per_rank))
    keys = {key for key, _ in indices}
    assert any("linear_fc1" in key for key in keys) and any("linear_fc2" in key for key in keys), keys
    assert {layer for _, layer in indices} == {0, 1}
    assert all(sorted(set(found)) == mine for found in indices.values()), indices  # fc1's halves: one key
