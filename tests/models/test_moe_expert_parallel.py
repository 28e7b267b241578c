"""Expert parallelism per agent (issue 52, item 2), what one process can check: the config keys and the layout check
(file, line, key), megatron's expert grid as a pure function against megatron's own RankGenerator, the EP rank's
share of the weights (loaded and exported by global expert), the alltoall dispatcher on a CPU, and the filler
micro-batches that keep EP ranks in step. The EP=2 model against EP=1 in a 2- and a 4-rank world:
tests/models/test_moe_expert_parallel_world.py (distributed).

One process: megatron models are built in a gloo world of this process alone (`world`); an EP rank's model is built
there with a stand-in EP group that says "rank r of 2" (building and loading need no exchange).
"""
import pytest
import torch

from hacpo_megatron.models.presets import PRESETS, attention_shape, layout_problems
from hacpo_megatron.parallel.groups import AgentParallel, expert_rank_groups
from tests.models import test_moe
from tests.models.test_moe import EXPERTS, VOCAB, random_hf_model, tiny_config

world = test_moe.world  # the fixture: one agent's groups in a gloo world of this process alone (module scope)


# ------------------------------------------------------------------------------------------------
# The layout check and the config keys
# ------------------------------------------------------------------------------------------------
def test_the_layout_check_names_a_bad_ep_by_its_key():
    moe, dense = attention_shape(PRESETS["qwen3-moe-tiny"]), attention_shape(PRESETS["tiny-qwen3"])
    assert layout_problems(moe, 1, 1, "m", dp=2, ep=2) == {}
    assert layout_problems(moe, 1, 1, "m", dp=8, ep=8) == {}
    assert layout_problems(moe, 1, 1, "m", dp=4, ep=2) == {}  # expert-DP 2
    assert layout_problems(moe, 1, 1, "m", dp=3, ep=3) == {"expert": "EP=3 must divide the 8 experts of m"}
    assert "EP=2 x ETP=1 must divide the 1 ranks of each pipeline stage" in layout_problems(moe, 1, 1, "m", ep=2)[
        "expert"]
    assert "must divide the 6 ranks" in layout_problems(moe, 1, 1, "m", dp=6, ep=4)["expert"]
    assert "not supported yet" in layout_problems(moe, 1, 1, "m", dp=2, etp=2)["expert_tensor"]
    assert "has none" in layout_problems(dense, 1, 1, "d", dp=2, ep=2)["expert"]
    assert "has none" in layout_problems(dense, 1, 1, "d", dp=2, etp=2)["expert_tensor"]
    assert layout_problems(dense, 2, 2, "d", dp=2) == {}  # a dense model's layouts: unchanged


AGENTS = "run:\n  name: t\nagents:\n  - name: m\n    model: qwen3-moe-tiny\n    tokenizer: qwen3\n{parallel}" \
         "  - name: d\n    model: tiny-llama\n{dense_parallel}"


@pytest.mark.parametrize("parallel,dense_parallel,line,key,message", [
    ("    parallel: {data: 3, expert: 3}\n", "", 7, "agents.0.parallel.expert", "EP=3 must divide the 8 experts"),
    ("    parallel: {expert: 2}\n", "", 7, "agents.0.parallel.expert", "EP=2 x ETP=1 must divide the 1 ranks"),
    ("    parallel:\n      data: 2\n      expert_tensor: 2\n", "", 9, "agents.0.parallel.expert_tensor",
     "ETP=2 (tensor parallelism inside each expert) is not supported yet"),
    ("    parallel: {expert: 0}\n", "", 7, "agents.0.parallel.expert", "must be >= 1"),
    ("", "    parallel: {data: 2, expert: 2}\n", 9, "agents.1.parallel.expert",
     "EP=2 splits the experts of a mixture-of-experts model; tiny-llama has none"),
], ids=["ep_not_dividing_the_experts", "ep_without_the_ranks", "expert_tensor", "ep_0", "ep_on_a_dense_model"])
def test_a_bad_ep_is_a_config_error_naming_file_line_and_key(tmp_path, parallel, dense_parallel, line, key, message):
    from hacpo_megatron.config import ConfigError, load_config

    config = tmp_path / "moe.yaml"
    config.write_text(AGENTS.format(parallel=parallel, dense_parallel=dense_parallel))
    with pytest.raises(ConfigError) as error:
        load_config(str(config))
    assert f"moe.yaml:{line}: {key}: {message}" in str(error.value), str(error.value)


def test_ep2_at_dp2_is_a_valid_layout(tmp_path):
    from hacpo_megatron.config import load_config

    config = tmp_path / "moe.yaml"
    config.write_text(AGENTS.format(parallel="    parallel: {data: 4, expert: 2}\n", dense_parallel=""))
    parallel = load_config(str(config)).agents[0].parallel
    assert (parallel.data, parallel.expert, parallel.expert_tensor, parallel.world_size) == (4, 2, 1, 4)


def test_resuming_an_optimizers_state_at_another_ep_is_refused_by_name(tmp_path):
    """A step folder whose agent "m" was saved with its optimizer at EP 2: resuming it at EP 1 or 4 is refused,
    naming its metadata.json and both EPs (training/run_checkpoints.py `layout_problems`, which `choose_checkpoint`
    runs before any model is built; the load refuses the same: tests/models/test_moe_expert_parallel_checkpoint.py).
    At EP 2, or for a folder without optimizer state (weights load at any EP), nothing."""
    import dataclasses
    import json

    from hacpo_megatron.checkpoint.format import CheckpointMetadata
    from hacpo_megatron.config.schema import AgentConfig, ParallelConfig
    from hacpo_megatron.training.run_checkpoints import layout_problems

    for name, has_optimizer in (("m", True), ("weights", False)):
        folder = tmp_path / name
        (folder / "dist_checkpoint").mkdir(parents=True)
        for part in ("hf_config.json", "dist_checkpoint/metadata.json", "dist_checkpoint/.metadata"):
            (folder / part).write_text("{}")
        metadata = CheckpointMetadata(hf_architecture="Qwen3MoeForCausalLM", vocab_size=VOCAB, padded_vocab_size=1024,
                                      tensor_parallel=1, pipeline_parallel=1, has_optimizer=has_optimizer,
                                      agent_name=name, step=1, expert_parallel=2)
        (folder / "metadata.json").write_text(json.dumps(dataclasses.asdict(metadata)))

    def agents(ep):
        return [AgentConfig(name=name, model="x", parallel=ParallelConfig(data=4, expert=ep))
                for name in ("m", "weights", "not_saved")]

    assert layout_problems(tmp_path, agents(2)) == []
    for ep in (1, 4):
        [problem] = layout_problems(tmp_path, agents(ep))
        assert problem.startswith(f"{tmp_path / 'm' / 'metadata.json'}: saved at expert parallelism 2, the agent now "
                                  f"has parallel.expert {ep};"), problem
        assert "Resume with parallel.expert: 2" in problem


def test_the_dispatcher_is_alltoall_at_ep_above_1_and_marks_the_experts():
    from hacpo_megatron.models.architectures import read_architecture, transformer_config

    arch = read_architecture(tiny_config())
    one, two = transformer_config(arch), transformer_config(arch, expert_parallel=2, expert_tensor_parallel=1)
    assert (one.moe_token_dispatcher_type, one.expert_model_parallel_size) == ("allgather", 1)
    assert (two.moe_token_dispatcher_type, two.expert_model_parallel_size, two.expert_tensor_parallel_size) == (
        "alltoall", 2, 1)
    # pipeline stages exchange variable sequence lengths, which megatron's allgather dispatcher refuses (a ValueError
    # building the config): alltoall there at EP 1 too (the conversion tools build MoE models at PP > 1)
    for ep in (1, 2):
        staged = transformer_config(arch, pipeline_parallel=2, expert_parallel=ep)
        assert (staged.moe_token_dispatcher_type, staged.variable_seq_lengths) == ("alltoall", True)


# ------------------------------------------------------------------------------------------------
# The expert grid: pure arithmetic, against megatron's own
# ------------------------------------------------------------------------------------------------
LAYOUTS = [  # (TP, DP, PP, EP, ETP)
    (1, 2, 1, 2, 1), (1, 4, 1, 2, 1), (1, 4, 2, 2, 1), (1, 8, 1, 4, 1), (1, 4, 1, 1, 1), (2, 4, 1, 4, 2),
    (2, 2, 2, 2, 1), (4, 2, 1, 2, 2),
]


@pytest.mark.parametrize("tp,dp,pp,ep,etp", LAYOUTS)
def test_the_expert_grid_is_megatrons(tp, dp, pp, ep, etp):
    """The groups `expert_rank_groups` gives are those megatron's initialize_model_parallel builds for the same sizes
    (its expert RankGenerator, order tp-cp-ep-dp-pp), here at an agent whose ranks start at 3; its pipeline groups
    are the decoder grid's (megatron asserts that)."""
    from megatron.core.parallel_state import RankGenerator

    first = 3
    edp = tp * dp // (ep * etp)
    megatron = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order="tp-cp-ep-dp-pp", rank_offset=first)
    decoder = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp", rank_offset=first)
    for dims in (["tp"], ["ep"], ["dp"], ["pp"], ["tp", "ep"], ["tp", "ep", "pp"], ["ep", "dp"]):
        assert expert_rank_groups(first, tp, dp, pp, ep, etp, dims) == megatron.get_ranks("-".join(dims)), dims
    assert expert_rank_groups(first, tp, dp, pp, ep, etp, ["pp"]) == decoder.get_ranks("pp")


@pytest.mark.parametrize("tp,dp,pp,ep,etp", LAYOUTS)
def test_an_agent_rank_knows_its_place_in_the_expert_grid(tp, dp, pp, ep, etp):
    """AgentParallel's EP, ETP and expert-DP ranks are its positions in the groups above, and
    `expert_global_rank_of` inverts them."""
    first, size = 3, tp * dp * pp
    ranks = tuple(range(first, first + size))
    groups = {d: expert_rank_groups(first, tp, dp, pp, ep, etp, [d]) for d in ("tp", "ep", "dp")}
    for rank in ranks:
        p = AgentParallel(name="a", ranks=ranks, tp_size=tp, pp_size=pp, dp_size=dp, rank=rank, pg_collection=None,
                          ep_size=ep, etp_size=etp)
        [etp_group] = [g for g in groups["tp"] if rank in g]
        [ep_group] = [g for g in groups["ep"] if rank in g]
        [edp_group] = [g for g in groups["dp"] if rank in g]
        assert (p.etp_rank, p.ep_rank, p.expert_dp_rank) == (etp_group.index(rank), ep_group.index(rank),
                                                              edp_group.index(rank))
        assert p.expert_dp_size == tp * dp // (ep * etp)
        assert p.expert_global_rank_of(etp_rank=p.etp_rank, ep_rank=p.ep_rank, expert_dp_rank=p.expert_dp_rank,
                                       pp_rank=p.pp_rank) == rank


def test_the_expert_grid_refuses_an_ep_that_does_not_divide_the_stage(world):
    """Also where groups are made (a config the loader did not check): before any group is created."""
    from hacpo_megatron.config.schema import AgentConfig, ParallelConfig
    from hacpo_megatron.parallel.groups import create_agent_groups

    with pytest.raises(ValueError, match="must divide each stage's TP=1 x DP=3 ranks"):
        expert_rank_groups(0, 1, 3, 1, 2, 1, ["ep"])
    with pytest.raises(ValueError, match="EP=2 x ETP=1 must divide each stage's TP=1 x DP=1 ranks"):
        create_agent_groups([AgentConfig(name="m", model="x", parallel=ParallelConfig(expert=2, first_rank=0))])


# ------------------------------------------------------------------------------------------------
# The megatron side in this process's one-rank world
# ------------------------------------------------------------------------------------------------
class _StandInGroup:
    """What building a model asks of a process group (its size and this rank's place), for an EP group this one
    process does not have. Nothing is exchanged through it."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def ep_rank_parallel(world, ep_rank, ep_size=2):
    """This process as EP rank `ep_rank` of an agent at DP = EP = `ep_size` (TP 1, PP 1): its agent rank is
    `ep_rank` (the other ranks of the tuple are never reached)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    stand_in = _StandInGroup(ep_size, ep_rank)
    collection = ProcessGroupCollection(**dict(vars(world.pg_collection), ep=stand_in, tp_ep=stand_in))
    ranks = (tuple(100 + r for r in range(ep_rank)) + (world.rank,)
             + tuple(200 + r for r in range(ep_size - ep_rank - 1)))
    return AgentParallel(name="moe", ranks=ranks, tp_size=1, pp_size=1, dp_size=ep_size, rank=world.rank,
                         pg_collection=collection, group=world.group, ep_size=ep_size, etp_size=1)


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_an_ep_rank_loads_its_own_experts_by_their_global_index(world, ep_rank):
    """EP rank r of 2 holds experts 4r .. 4r + 3 as its local experts 0 .. 3: each equal to the HF expert of that
    global index (a checkpoint's per-expert tensors, or a transformers model's fused ones), the router and the rest
    as at EP 1. The model's MoE layers say the same indices (megatron's `local_expert_indices`)."""
    from hacpo_megatron.checkpoint.hf_mapping import load_hf_state_dict_into_model, local_tensors
    from hacpo_megatron.models.build import build_agent_model

    hf = random_hf_model(tiny_config(), seed=7)
    hf_config, state = tiny_config().to_dict(), hf.state_dict()
    parallel = ep_rank_parallel(world, ep_rank)
    assert (parallel.ep_rank, parallel.dp_rank, parallel.expert_dp_rank) == (ep_rank, ep_rank, 0)
    agent = build_agent_model(hf_config, parallel, seed=1, params_dtype=torch.float32)
    assert agent.config.moe_token_dispatcher_type == "alltoall"
    load_hf_state_dict_into_model(agent.model, state, hf_config, parallel)
    per_rank = EXPERTS // 2
    mine = list(range(ep_rank * per_rank, (ep_rank + 1) * per_rank))
    one = build_agent_model(hf_config, world, seed=1, params_dtype=torch.float32)
    load_hf_state_dict_into_model(one.model, state, hf_config, world)
    reference = dict(one.model.named_parameters())
    for layer in agent.model.decoder.layers:
        assert layer.mlp.local_expert_indices == mine and len(layer.mlp.experts.local_experts) == per_rank
    names = set()
    for name, param in agent.model.named_parameters():
        if ".local_experts." in name:  # local expert i here is global expert mine[i] of the EP 1 model
            prefix, rest = name.split(".local_experts.")
            i, tail = rest.split(".", 1)
            name = f"{prefix}.local_experts.{mine[int(i)]}.{tail}"
        assert torch.equal(param, reference[name]), name
        names.add(name)
    assert len(names) == len(list(agent.model.named_parameters()))
    experts = sorted({t.expert for t in local_tensors(agent.model, agent.arch) if t.expert is not None})
    assert experts == mine


def test_every_expert_is_exported_by_its_owner():
    """The export's owner table: the experts of EP rank r are sent by the rank holding them (expert-DP replica 0);
    everything else by data-parallel replica 0, as at EP 1."""
    from hacpo_megatron.checkpoint.hf_mapping import _hf_tensor_owners
    from hacpo_megatron.models.architectures import read_architecture

    arch = read_architecture(tiny_config())
    parallel = AgentParallel(name="a", ranks=(0, 1, 2, 3), tp_size=1, pp_size=1, dp_size=4, rank=0,
                             pg_collection=None, ep_size=2, etp_size=1)
    owners = {name: (stage, ep_rank) for name, stage, ep_rank in _hf_tensor_owners(arch, parallel)}
    for layer in range(arch.num_layers):
        for e in range(EXPERTS):
            ep_rank = e // (EXPERTS // 2)
            assert owners[f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight"] == (0, ep_rank)
            assert owners[f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight"] == (0, ep_rank)
            # EP rank 1's experts come from agent rank 1 (DP replica 1, expert-DP replica 0); EP rank 0's from rank 0
            assert parallel.expert_global_rank_of(etp_rank=0, ep_rank=ep_rank, expert_dp_rank=0, pp_rank=0) == ep_rank
        assert owners[f"model.layers.{layer}.mlp.gate.weight"] == (0, None)
    assert owners["model.embed_tokens.weight"] == (0, None)


def test_the_alltoall_dispatcher_computes_what_allgather_does_on_a_cpu(world):
    """The dispatcher of EP > 1, with megatron_cpu's shim (its CUDA stream, its split sizes as host arrays), at EP 1
    in this process: the same logits and the same gradients of the router and the experts as the allgather one."""
    from hacpo_megatron import megatron_cpu
    from hacpo_megatron.checkpoint.hf_mapping import load_hf_state_dict_into_model
    from hacpo_megatron.models.build import build_agent_model

    assert "alltoall-token-dispatcher->cpu" in megatron_cpu.applied_patches() or torch.cuda.is_available()
    hf_config, state = tiny_config().to_dict(), random_hf_model(tiny_config(), seed=7).state_dict()
    tokens = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(4))
    weights = torch.randn(3, 11, VOCAB, generator=torch.Generator().manual_seed(5))
    out = {}
    for dispatcher in ("allgather", "alltoall"):
        agent = build_agent_model(hf_config, world, seed=1, params_dtype=torch.float32,
                                  moe_token_dispatcher_type=dispatcher)
        assert agent.config.moe_token_dispatcher_type == dispatcher
        load_hf_state_dict_into_model(agent.model, state, hf_config, world)
        device = next(agent.model.parameters()).device
        positions = torch.arange(tokens.shape[1], device=device).expand(tokens.shape)
        logits = agent.model(tokens.to(device), positions, attention_mask=None)[..., :VOCAB]
        (logits * weights.to(device)).sum().backward()
        out[dispatcher] = (logits.detach().cpu(), {n: p.grad.detach().cpu().clone() if p.grad is not None else None
                                                   for n, p in agent.model.named_parameters() if ".mlp." in n})
    (logits_gather, grads_gather), (logits_a2a, grads_a2a) = out["allgather"], out["alltoall"]
    difference = (logits_a2a - logits_gather).abs().max().item()
    print(f"\nalltoall vs allgather: max |logit difference| {difference:.1e}")
    assert difference <= 1e-5
    assert set(grads_a2a) == set(grads_gather)
    reached = [n for n, g in grads_gather.items() if g is not None and g.abs().max() > 0]
    assert len([n for n in reached if ".local_experts." in n]) >= EXPERTS  # most experts got tokens, in both layers
    for name, grad in grads_gather.items():
        if grad is None:  # an expert no token reached
            assert grads_a2a[name] is None, name
            continue
        assert (grads_a2a[name] - grad).abs().max().item() <= 1e-5 * max(grad.abs().max().item(), 1e-30), name


# ------------------------------------------------------------------------------------------------
# Filler micro-batches: what an EP rank runs to stay in step with its peers adds nothing
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_folder(module_tmp):
    folder = module_tmp("qwen3_moe_ep")
    random_hf_model(tiny_config(), seed=7).save_pretrained(folder)
    return folder


def _trainer(folder, world, **moe_keys):
    from hacpo_megatron.algorithms.registry import algorithm_spec
    from hacpo_megatron.config.schema import AlgorithmConfig, MoEConfig
    from hacpo_megatron.training.trainer import AgentTrainer
    from tests.models.test_moe import build_from_folder
    from tests.training.workers.trainer_config import trainer_config

    config = trainer_config(lr=1e-3, grad_clip=0.0, micro_batch_size=2)
    return AgentTrainer(build_from_folder(folder, world), algorithm_spec(AlgorithmConfig(name="gspo")), config,
                        moe=MoEConfig(**moe_keys))


def _with_fillers(count):
    from hacpo_megatron.models.packing import filler_micro_batch

    def in_step(agent, micro_batches):
        return list(micro_batches) + [filler_micro_batch() for _ in range(count)]
    return in_step


def test_filler_micro_batches_change_no_gradient_figure_or_log_prob(moe_folder, world, monkeypatch):
    """An EP rank with fewer micro-batches than its peers runs fillers after its own (models/logprobs.py:
    in_step_with_expert_peers). Here two fillers after every pass's and update's own micro-batches, in one process:
    the update's gradients (policy and load-balancing loss) and figures and the pass's log-probs are exactly those
    without them, and a pass or an update with no rows of its own runs the fillers alone."""
    from hacpo_megatron.models import logprobs
    from hacpo_megatron.models.moe_router import ROUTER_METRICS
    from hacpo_megatron.training import trainer as trainer_module
    from tests.models.test_moe import moe_rows

    results = {}
    for fillers in (0, 2):
        trainer = _trainer(moe_folder, world, aux_loss_coeff=0.1)
        rows = moe_rows(trainer, [3, 6, 4])  # the old log-probs: a pass without fillers
        with monkeypatch.context() as patch:
            patch.setattr(logprobs, "in_step_with_expert_peers", _with_fillers(fillers))
            patch.setattr(trainer_module, "in_step_with_expert_peers", _with_fillers(fillers))
            passed = trainer.sequence_logprobs([(r.prompt_ids, r.response_ids) for r in rows])
            [figures] = trainer.train_step([rows])
            empty = trainer.sequence_logprobs([])
        grads = {n: p.main_grad.detach().clone() for n, p in trainer.ddp_model.module.named_parameters()}
        results[fillers] = passed, figures, grads
        assert empty.token_logprobs.numel() == 0
    (passed, figures, grads), (passed_f, figures_f, grads_f) = results[0], results[2]
    assert torch.equal(passed.token_logprobs, passed_f.token_logprobs)
    for key in ("loss", "grad_norm", "num_own", *ROUTER_METRICS):
        assert figures_f[key] == figures[key], key
    assert figures["moe/aux_loss"] > 0 and figures["micro_batch_tokens_max"] == figures_f["micro_batch_tokens_max"]
    for name, grad in grads.items():
        assert torch.equal(grads_f[name], grad), name


def test_a_filler_is_padding_to_the_routers(moe_folder, world):
    """The load figures and loss of an update made of fillers alone count no token (no 0 / 0 either)."""
    from hacpo_megatron.models.logprobs import make_forward_step, run_schedule
    from hacpo_megatron.models.packing import filler_micro_batch

    trainer = _trainer(moe_folder, world, aux_loss_coeff=0.1)
    trainer.ddp_model.train()
    trainer.ddp_model.zero_grad_buffer()
    trainer.router_load.begin_update(10)
    results = run_schedule(trainer.agent, [filler_micro_batch(), filler_micro_batch()],
                           make_forward_step(trainer.agent, loss_fn=lambda *_: pytest.fail("a filler's loss")),
                           forward_only=False)
    sums = trainer.router_load.end_update()
    assert results == [] and torch.equal(sums, torch.zeros_like(sums))
    for param in trainer.ddp_model.module.parameters():
        assert not param.main_grad.any()


def test_a_pass_with_no_sequences_of_its_own_keeps_no_routes(moe_folder, world, monkeypatch):
    """A replica's share of a log-prob pass can be empty (at EP > 1 it then runs fillers alone). With routing replay
    the pass gives no log-probs and an empty list of routes, which the trainer keeps (nothing): the routes used to be
    None there, and keeping them failed (`len(None)`)."""
    from hacpo_megatron.models import logprobs

    trainer = _trainer(moe_folder, world, routing_replay="r2")
    for fillers in (0, 2):
        with monkeypatch.context() as patch:
            patch.setattr(logprobs, "in_step_with_expert_peers", _with_fillers(fillers))
            result = trainer.sequence_logprobs([])
        assert result.routes == [] and result.token_logprobs.numel() == 0 and result.lengths.numel() == 0
    assert len(trainer.route_replay) == 0


def test_the_compare_tools_logits_are_the_models(world):
    """tools/compare_hf_megatron.py's pass through megatron's schedule (`run_schedule`), whose micro-batch is a type of
    its own with no `filler`, gives the model's logits (AttributeError once run_schedule read the fillers)."""
    from hacpo_megatron.checkpoint.hf_mapping import load_hf_state_dict_into_model
    from hacpo_megatron.models.build import build_agent_model
    from tests.checkpoint.workers.checkpoint_worker import load_tool
    from tests.models.test_moe import megatron_logits, tokens_batch

    hf_config = tiny_config().to_dict()
    agent = build_agent_model(hf_config, world, seed=1, params_dtype=torch.float32)
    load_hf_state_dict_into_model(agent.model, random_hf_model(tiny_config(), seed=2).state_dict(), hf_config, world)
    tokens = tokens_batch()
    through_schedule = load_tool("compare_hf_megatron").megatron_logits(agent, tokens)
    assert through_schedule.shape == (*tokens.shape, VOCAB)
    assert torch.equal(through_schedule, megatron_logits(agent, tokens))
