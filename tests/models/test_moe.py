"""Qwen3-MoE as a model family (item 1 of issue 52): the HF config read into megatron's MoE settings, logits of the
megatron model equal to transformers' Qwen3MoeForCausalLM, exact weight round trips, and what the family refuses.
The loss and the router (item 3): the load-balancing loss's gradient against a float64 reference, its weight whatever
the micro-batches, two MoE agents in one process, a frozen router, the router keys of the config. Routing replay
(item 4): forced routes against transformers routed alike, R2 and R3 in the pass and the updates, two agents' routes
apart, the engine-vs-trainer figures of off / r2 / r3 (docs/moe.md).

One process: the megatron models are built in a gloo world of this one process (`world`, torn down at the end of
the module), at expert parallelism 1 (EP > 1: test_moe_expert_parallel.py and its torchrun test, docs/moe.md).
"""
import functools
import math
from pathlib import Path

import pytest
import torch

from hacpo_megatron.models.architectures import MoE, read_architecture, transformer_config
from hacpo_megatron.models.presets import PRESETS, attention_shape, layout_problems

VOCAB = 1000  # not a multiple of 128: megatron pads it
EXPERTS, TOP_K = 8, 2
TOLERANCE = 1e-4  # max |logit difference| in float32, as the dense and Gemma 3 parity tests allow


def tiny_config(**changes):
    """A transformers Qwen3MoeConfig: 2 layers, 8 experts, 2 per token, untied embeddings."""
    import transformers

    settings = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
                    num_experts=EXPERTS, num_experts_per_tok=TOP_K, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, norm_topk_prob=True, router_aux_loss_coef=0.02,
                    tie_word_embeddings=False, max_position_embeddings=256, bos_token_id=0, eos_token_id=1)
    settings.update(changes)
    return transformers.Qwen3MoeConfig(**settings)


# ------------------------------------------------------------------------------------------------
# (a) the config mapping
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_the_hf_config_becomes_megatrons_moe_settings(norm_topk_prob):
    hf_config = tiny_config(norm_topk_prob=norm_topk_prob)
    arch = read_architecture(hf_config)
    # a config object, its to_dict() (transformers 5 writes num_experts as num_local_experts and no architectures)
    assert read_architecture(hf_config.to_dict()) == arch
    assert arch.family == "qwen3_moe" and arch.hf_architecture == "Qwen3MoeForCausalLM"
    assert arch.qk_layernorm and not arch.qkv_bias and not arch.tie_word_embeddings
    assert arch.moe == MoE(num_experts=8, top_k=2, ffn_hidden_size=48, norm_topk_prob=norm_topk_prob,
                           aux_loss_coeff=0.02)
    config = transformer_config(arch)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (8, 2, 48)
    # renormalised top-k probabilities = softmax over the top-k logits; unnormalised = softmax first, then top-k
    assert config.moe_router_score_function == "softmax"
    assert config.moe_router_pre_softmax is (not norm_topk_prob)
    assert config.moe_router_topk_scaling_factor is None
    # megatron's own load-balancing loss is off: the trainer's RouterLoad adds it per model (models/moe_router.py),
    # weighted by agents[].moe.aux_loss_coeff; the checkpoint's coefficient is read, not applied
    assert config.moe_aux_loss_coeff == 0.0 and config.moe_router_load_balancing_type == "none"
    # dropless, one MLP per expert, no shared experts, the dispatcher that runs as is at EP 1
    assert config.moe_expert_capacity_factor is None and not config.moe_pad_expert_input_to_capacity
    assert config.moe_token_dispatcher_type == "allgather" and not config.moe_grouped_gemm
    assert config.moe_shared_expert_intermediate_size is None and config.qk_layernorm


def test_a_released_qwen3_moe_config_json_is_read():
    """Qwen3-30B-A3B's config.json (as transformers 4.51 wrote it: `num_experts`, `rope_theta`)."""
    config_json = dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", attention_bias=False, decoder_sparse_step=1,
        head_dim=128, hidden_act="silu", hidden_size=2048, intermediate_size=6144, max_position_embeddings=40960,
        mlp_only_layers=[], moe_intermediate_size=768, norm_topk_prob=True, num_attention_heads=32, num_experts=128,
        num_experts_per_tok=8, num_hidden_layers=48, num_key_value_heads=4, output_router_logits=False,
        rms_norm_eps=1e-6, rope_scaling=None, rope_theta=1000000.0, router_aux_loss_coef=0.001, sliding_window=None,
        tie_word_embeddings=False, use_sliding_window=False, vocab_size=151936, bos_token_id=151643,
        eos_token_id=151645)
    arch = read_architecture(config_json)
    assert arch.moe == MoE(num_experts=128, top_k=8, ffn_hidden_size=768, norm_topk_prob=True, aux_loss_coeff=0.001)
    assert (arch.num_layers, arch.num_attention_heads, arch.num_query_groups, arch.rope_theta) == (48, 32, 4, 1e6)
    assert attention_shape(config_json)["num_experts"] == 128


def test_the_tiny_preset():
    preset = PRESETS["qwen3-moe-tiny"]
    arch = read_architecture(preset)
    assert arch.family == "qwen3_moe" and arch.vocab_size == PRESETS["tiny-qwen3"]["vocab_size"]  # Qwen3's tokenizer
    assert (arch.hidden_size, arch.num_layers, arch.num_attention_heads, arch.num_query_groups) == (64, 2, 4, 2)
    assert arch.moe == MoE(num_experts=8, top_k=2, ffn_hidden_size=96, norm_topk_prob=True, aux_loss_coeff=0.001)
    assert attention_shape(preset)["num_experts"] == 8 and attention_shape(PRESETS["tiny-qwen3"])["num_experts"] == 0


# ------------------------------------------------------------------------------------------------
# (d) what the family refuses
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes,key", [
    (dict(decoder_sparse_step=2), "decoder_sparse_step"),
    (dict(mlp_only_layers=[0]), "mlp_only_layers"),
    (dict(shared_expert_intermediate_size=32), "shared_expert_intermediate_size"),  # Qwen2-MoE's shared expert
    (dict(num_experts_per_tok=1, norm_topk_prob=True), "norm_topk_prob"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(use_sliding_window=True), "use_sliding_window"),
])
def test_an_unsupported_setting_is_refused_by_its_key(changes, key):
    with pytest.raises(ValueError, match=f"{key}="):
        read_architecture(tiny_config(**changes).to_dict())


def test_top_1_without_renormalisation_is_supported():
    arch = read_architecture(tiny_config(num_experts_per_tok=1, norm_topk_prob=False))
    assert arch.moe.top_k == 1 and transformer_config(arch).moe_router_pre_softmax


def test_tp_above_1_is_refused_by_its_key_and_pp_takes_what_divides_the_layers(tmp_path):
    from hacpo_megatron.config import ConfigError, load_config

    shape = attention_shape(PRESETS["qwen3-moe-tiny"])
    assert layout_problems(shape, 1, 1, "qwen3-moe-tiny") == {}
    assert "sequence parallelism" in layout_problems(shape, 2, 1, "qwen3-moe-tiny")["tensor"]
    assert layout_problems(shape, 1, 2, "qwen3-moe-tiny", dp=2, ep=2) == {}  # tests/models/test_moe_pipeline.py
    assert "must divide the 2 layers" in layout_problems(shape, 1, 4, "qwen3-moe-tiny")["pipeline"]
    # a model built for its weights and eval passes (the conversion tools) takes them
    assert layout_problems(shape, 2, 2, "qwen3-moe-tiny", training=False) == {}
    assert layout_problems(attention_shape(PRESETS["tiny-qwen3"]), 2, 2, "tiny-qwen3") == {}  # dense: unchanged
    config = tmp_path / "moe.yaml"
    config.write_text("run:\n  name: t\nagents:\n  - name: m\n    model: qwen3-moe-tiny\n    tokenizer: qwen3\n"
                      "  - name: d\n    model: tiny-llama\n")
    assert load_config(str(config)).agents[0].model == "qwen3-moe-tiny"
    config.write_text(config.read_text().replace("tokenizer: qwen3\n", "tokenizer: qwen3\n    parallel: {tensor: 2}\n"))
    with pytest.raises(ConfigError, match=r"moe\.yaml:7.*parallel\.tensor: TP=2 with the mixture of experts"):
        load_config(str(config))


# ------------------------------------------------------------------------------------------------
# The megatron side: a gloo world of this one process
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world():
    """One agent's process groups on rank 0 of a world of this process alone (torn down afterwards)."""
    import torch.distributed as dist

    from hacpo_megatron.config.schema import AgentConfig, ParallelConfig
    from hacpo_megatron.parallel.groups import create_agent_groups

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        [parallel] = create_agent_groups([AgentConfig(name="moe", model="x", parallel=ParallelConfig(first_rank=0))])
        yield parallel
    finally:
        if started:
            dist.destroy_process_group()


def random_hf_model(hf_config, seed=0):
    """A transformers Qwen3MoeForCausalLM in float32 whose weights are large enough that the experts and their
    routing weights move the logits by far more than the tolerance (at transformers' init, std 0.02, a wrong top-k
    normalisation changed them by 2e-5). Norm weights perturbed, so a mis-mapped norm shows."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif "embed_tokens" in name or "lm_head" in name:
                param.normal_(0.0, 1.0)
            else:  # projections, experts [E, out, in], router [E, in]: unit-variance outputs
                param.normal_(0.0, param.shape[-1] ** -0.5)
    return model


def tokens_batch():
    return torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(1))


def megatron_logits(agent, tokens):
    """The model's logits for CPU tokens, back on the CPU (the model is on the GPU where there is one)."""
    device = next(agent.model.parameters()).device
    tokens = tokens.to(device)
    positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
    agent.model.eval()
    with torch.no_grad():
        return agent.model(tokens, positions, attention_mask=None)[..., :VOCAB].cpu()


def routes(modules, pick):
    """Forward hooks on `modules` collecting `pick(output)` of every call; call `.remove()` on each handle after."""
    seen, handles = [], []
    for module in modules:
        handles.append(module.register_forward_hook(lambda _m, _i, output: seen.append(pick(output))))
    return seen, handles


def build_from_folder(folder, parallel):
    from hacpo_megatron.checkpoint.hf_io import HFWeights, read_hf_config
    from hacpo_megatron.checkpoint.hf_mapping import load_hf_state_dict_into_model
    from hacpo_megatron.models.build import build_agent_model

    hf_config = read_hf_config(folder)
    agent = build_agent_model(hf_config, parallel, seed=1, params_dtype=torch.float32)
    load_hf_state_dict_into_model(agent.model, HFWeights(folder), hf_config, parallel)
    return agent


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk_prob", "unnormalised"])
def pair(request, world, module_tmp):
    """(HF model, its checkpoint folder, the megatron model loaded from that folder)."""
    hf = random_hf_model(tiny_config(norm_topk_prob=request.param))
    folder = Path(module_tmp(f"qwen3_moe_{request.param}"))
    hf.save_pretrained(folder)
    return hf, folder, build_from_folder(folder, world)


# ------------------------------------------------------------------------------------------------
# (b) logits against transformers
# ------------------------------------------------------------------------------------------------
def test_logits_equal_transformers_and_tokens_reach_many_experts(pair):
    hf, _, agent = pair
    tokens = tokens_batch()
    megatron_routes, handles = routes([layer.mlp.router for layer in agent.model.decoder.layers],
                                      lambda output: output[1].cpu())  # routing map [tokens, experts]
    hf_routes, hf_handles = routes([layer.mlp.gate for layer in hf.model.layers],
                                   lambda output: output[2].clone())  # top-k expert indices [tokens, k]
    try:
        logits = megatron_logits(agent, tokens)
        with torch.no_grad():
            reference = hf(tokens).logits
    finally:
        for handle in handles + hf_handles:
            handle.remove()
    difference = (logits - reference).abs().max().item()
    print(f"\nmax |logit difference| {difference:.2e} (max |logit| {reference.abs().max().item():.1f})")
    assert reference.abs().max() > 5.0 and difference < TOLERANCE

    assert len(megatron_routes) == len(hf_routes) == 2  # one call per layer
    for layer, (routing_map, top_indices) in enumerate(zip(megatron_routes, hf_routes)):
        # megatron runs [seq, batch], transformers [batch, seq]: the same tokens, in another order
        hf_map = torch.zeros(tokens.numel(), EXPERTS, dtype=torch.bool).scatter(1, top_indices, True)
        hf_map = hf_map.view(tokens.shape[0], tokens.shape[1], EXPERTS).transpose(0, 1).reshape(-1, EXPERTS)
        assert torch.equal(routing_map, hf_map), layer
        assert (routing_map.sum(dim=1) == TOP_K).all()
        tokens_per_expert = routing_map.sum(dim=0)
        assert (tokens_per_expert > 0).sum() > 1, tokens_per_expert  # the batch is spread over the experts
        print(f"layer {layer}: tokens per expert {tokens_per_expert.tolist()}")


def test_a_wrong_normalisation_or_top_k_would_be_caught(pair):
    """The logits test has the power to fail: transformers' own model with the other normalisation, or one more
    expert per token, moves its logits by far more than the tolerance."""
    hf, _, _ = pair
    tokens = tokens_batch()
    routers = [layer.mlp.gate for layer in hf.model.layers]
    with torch.no_grad():
        reference = hf(tokens).logits
        try:
            for router in routers:
                router.norm_topk_prob = not router.norm_topk_prob
            other_normalisation = hf(tokens).logits
        finally:
            for router in routers:
                router.norm_topk_prob = not router.norm_topk_prob
        try:
            for router in routers:
                router.top_k += 1
            other_top_k = hf(tokens).logits
        finally:
            for router in routers:
                router.top_k -= 1
    assert (other_normalisation - reference).abs().max() > 1000 * TOLERANCE
    assert (other_top_k - reference).abs().max() > 1000 * TOLERANCE


# ------------------------------------------------------------------------------------------------
# (c) round trips
# ------------------------------------------------------------------------------------------------
def test_hf_to_megatron_to_hf_is_exact(pair, world):
    from hacpo_megatron.checkpoint.hf_io import HFWeights, read_hf_config
    from hacpo_megatron.checkpoint.hf_mapping import export_hf_state_dict

    _, folder, agent = pair
    saved = HFWeights(folder)
    exported = export_hf_state_dict(agent.model, read_hf_config(folder), world)
    assert set(exported) == set(saved)
    assert len([n for n in saved if ".mlp.experts." in n]) == 2 * EXPERTS * 3  # one tensor per expert and projection
    for name in saved:
        assert exported[name].dtype == saved[name].dtype and torch.equal(exported[name].cpu(), saved[name]), name


def test_a_transformers_models_fused_experts_load_as_its_checkpoint_does(pair, world):
    """transformers 5 keeps each layer's experts fused in memory (what the warm-up and the embedded engine hold):
    its state_dict() loads into the same megatron weights as the per-expert checkpoint it saves."""
    from hacpo_megatron.checkpoint.hf_io import read_hf_config
    from hacpo_megatron.checkpoint.hf_experts import PerExpertView
    from hacpo_megatron.checkpoint.hf_mapping import load_hf_state_dict_into_model
    from hacpo_megatron.models.build import build_agent_model

    hf, folder, agent = pair
    state = hf.state_dict()
    one_expert = "model.layers.0.mlp.experts.0.up_proj.weight"
    assert "model.layers.0.mlp.experts.gate_up_proj" in state and one_expert not in state
    assert one_expert in PerExpertView(state)
    hf_config = read_hf_config(folder)
    fused = build_agent_model(hf_config, world, seed=2, params_dtype=torch.float32)
    load_hf_state_dict_into_model(fused.model, state, hf_config, world)
    expected = dict(agent.model.named_parameters())
    for name, param in fused.model.named_parameters():
        assert torch.equal(param, expected[name]), name


def test_the_preset_builds_and_takes_the_weights_transformers_draws_for_it(world):
    """`model: qwen3-moe-tiny`: the random transformers model the warm-up and the embedded engine draw from the preset
    (its real 151,936-token vocabulary), loaded into the megatron model built from the same preset."""
    from hacpo_megatron.checkpoint.hf_mapping import load_hf_state_dict_into_model
    from hacpo_megatron.models.build import build_agent_model
    from hacpo_megatron.rollout.embedded import hf_model_from_config

    preset = PRESETS["qwen3-moe-tiny"]
    hf = hf_model_from_config(preset, seed=3)
    agent = build_agent_model(preset, world, seed=3, params_dtype=torch.float32)
    load_hf_state_dict_into_model(agent.model, hf.state_dict(), preset, world)
    tokens = torch.randint(0, preset["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(2))
    device = next(agent.model.parameters()).device
    positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
    agent.model.eval()
    with torch.no_grad():
        logits = agent.model(tokens.to(device), positions, attention_mask=None)[..., : preset["vocab_size"]].cpu()
        reference = hf(tokens).logits
    assert (logits - reference).abs().max().item() < TOLERANCE


def test_the_embedded_engine_takes_the_trainers_weights(pair, world):
    """The weight push to the embedded engine: the trainer sends one tensor per expert (checkpoint names); the
    engine's transformers model, which holds its experts fused, ends up with exactly those weights."""
    from hacpo_megatron.checkpoint.hf_io import read_hf_config
    from hacpo_megatron.checkpoint.hf_mapping import iter_hf_tensors
    from hacpo_megatron.rollout.embedded import EmbeddedEngine

    hf, folder, agent = pair
    engine = EmbeddedEngine(random_hf_model(hf.config, seed=5), None, eos_token_ids=[1], pad_token_id=0)
    sent = list(iter_hf_tensors(agent.model, read_hf_config(folder), world))
    assert not engine.check_weights(sent).equal  # another random model before the push
    engine.update_weights(sent)
    check = engine.check_weights(sent)
    assert check.equal and check.max_abs_diff == 0.0 and not (check.missing or check.unsent), check
    tokens = tokens_batch()
    with torch.no_grad():
        assert torch.equal(engine.model(tokens).logits, hf(tokens).logits)


@pytest.mark.parametrize("packing", [dict(max_tokens_per_micro_batch=48), dict(share_prompts=True)],
                         ids=["packed", "shared_prompts"])
def test_the_trainers_logprobs_equal_transformers_however_rows_are_packed(pair, packing):
    """Dropless routing: a token's experts do not depend on the other tokens of its micro-batch, so the trainer's
    log-prob pass (models/logprobs.py: sequences packed end to end, or responses sharing their prompt's row) gives
    transformers' log-probs of each sequence alone (with a capacity factor of 1 instead, every case here fails).
    The bound is the logits test's: these logits reach 36, divided by a temperature of 0.7."""
    from hacpo_megatron.models.logprobs import compute_sequence_logprobs
    from tests.models.workers.reference import SHARED_PROMPT_SEQUENCES, TEMPERATURE, hf_token_logprobs

    hf, _, agent = pair
    sequences = SHARED_PROMPT_SEQUENCES
    logprobs = compute_sequence_logprobs(agent, sequences, temperature=TEMPERATURE, **packing)
    with torch.no_grad():
        reference = hf_token_logprobs(hf, sequences)
    assert logprobs.lengths.tolist() == [len(r) for _, r in sequences]
    worst = max((logprobs.token_logprobs[i, : len(r)] - r).abs().max().item() for i, r in enumerate(reference))
    print(f"\nmax |log-prob difference| {worst:.2e}")
    assert worst < TOLERANCE


# ------------------------------------------------------------------------------------------------
# (e) the loss and the router (issue 52, item 3): the trainer, in this process's one-rank world
# ------------------------------------------------------------------------------------------------
# The load-balancing loss's weight in these tests. Its gradient in the routers is then 1/50 to 1/200 of the policy
# loss's, so their difference (the same update with coefficient 0 subtracted) keeps ~1e-5 of fp32 rounding relative
# to it: the tolerance is 1e-3; the errors it is there for were 80 % and more.
COEFF = 0.1


@pytest.fixture(scope="module")
def moe_folder(module_tmp):
    folder = Path(module_tmp("qwen3_moe_train"))
    random_hf_model(tiny_config(), seed=7).save_pretrained(folder)
    return folder


def moe_trainer(folder, world, *, micro_batch_size=2, share_prompts=True, **moe_keys):
    """A GSPO trainer of the MoE model saved in `folder` (fp32, no gradient clipping: the gradients are compared)."""
    from hacpo_megatron.algorithms.registry import algorithm_spec
    from hacpo_megatron.config.schema import AlgorithmConfig, MoEConfig
    from hacpo_megatron.training.trainer import AgentTrainer
    from tests.training.workers.trainer_config import trainer_config

    config = trainer_config(lr=1e-3, grad_clip=0.0, micro_batch_size=micro_batch_size, share_prompts=share_prompts)
    return AgentTrainer(build_from_folder(folder, world), algorithm_spec(AlgorithmConfig(name="gspo")), config,
                        moe=MoEConfig(**moe_keys))


def moe_rows(trainer, response_lengths, seed=0):
    """Own rows with distinct prompts of 5 tokens, responses of the given lengths (unequal: rows are padded),
    advantages +-1, old log-probs the trainer's model's (ratio 1: the policy loss has a gradient of its own)."""
    from hacpo_megatron.training.batch import SequenceRow

    g = torch.Generator().manual_seed(seed)
    sequences = [(torch.randint(2, VOCAB, (5,), generator=g).tolist(),
                  torch.randint(2, VOCAB, (length,), generator=g).tolist()) for length in response_lengths]
    old = trainer.sequence_logprobs(sequences)
    return [SequenceRow(prompt_ids=prompt, response_ids=response, advantage=1.0 if i % 2 else -1.0,
                        old_seq_logp=float(old.sums[i] / old.lengths[i]), is_cross=False, source=0, prompt_index=i)
            for i, (prompt, response) in enumerate(sequences)]


def router_gradients(trainer):
    """Each layer's router-weight gradient of the trainer's last update (float64 copies)."""
    return [layer.mlp.router.weight.main_grad.detach().double().clone()
            for layer in trainer.ddp_model.module.decoder.layers]


def reference_load_balancing(folder, micro_batches):
    """Independently of megatron: transformers' model in float64, each sequence alone, its routers' logits; megatron's
    per-layer loss E / (k T_b^2) sum_e c_e S_e of each micro-batch's tokens, weighted by T_b / T, summed over layers.
    Returns (the loss, its gradient with respect to each layer's router weight, tokens per expert [layers, E])."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, experts_implementation="eager")
    seen = []
    handles = [layer.mlp.gate.register_forward_hook(lambda _m, _i, output, index=index: seen.append((index, output[0])))
               for index, layer in enumerate(hf.model.layers)]
    layers = len(hf.model.layers)
    total_tokens = sum(len(r.prompt_ids) + len(r.response_ids) for chunk in micro_batches for r in chunk)
    loss, counts = torch.zeros((), dtype=torch.float64), torch.zeros(layers, EXPERTS, dtype=torch.float64)
    try:
        for chunk in micro_batches:
            seen.clear()
            for row in chunk:
                hf(torch.tensor([row.prompt_ids + row.response_ids]))
            tokens = sum(len(r.prompt_ids) + len(r.response_ids) for r in chunk)
            for layer in range(layers):
                logits = torch.cat([out for index, out in seen if index == layer])
                routed = torch.zeros_like(logits).scatter(1, logits.topk(TOP_K, dim=1).indices, 1.0).sum(dim=0)
                aux = EXPERTS / (TOP_K * tokens ** 2) * (routed * logits.softmax(dim=-1).sum(dim=0)).sum()
                loss = loss + tokens / total_tokens * aux
                counts[layer] += routed.detach()
    finally:
        for handle in handles:
            handle.remove()
    loss.backward()
    return loss.item(), [layer.mlp.gate.weight.grad for layer in hf.model.layers], counts


def test_the_load_balancing_gradient_is_the_coefficient_times_the_token_weighted_loss(moe_folder, world):
    """One update of 4 rows in 2 micro-batches of unequal tokens (18 and 26, padded rows): the routers' gradient with
    moe.aux_loss_coeff c minus the gradient with 0 (the same update otherwise) is c times the gradient of the loss
    sum_l sum_b (T_b / T) aux_{b,l} over the real tokens, against a float64 reference built without megatron; the
    update's figures are that loss and the reference's tokens per expert.

    Before this (megatron's own loss, whose router read `calculate_per_token_loss` before the trainer set it: each
    micro-batch's loss unscaled, padding counted), the same comparison gave 1.96 and 1.71 times the reference's norm
    in the two layers (118 % and 81 % off)."""
    updates, gradients = {}, {}
    for coeff in (COEFF, 0.0):
        trainer = moe_trainer(moe_folder, world, aux_loss_coeff=coeff)
        rows = moe_rows(trainer, [3, 5, 7, 9])
        [updates[coeff]] = trainer.train_step([rows])
        gradients[coeff] = router_gradients(trainer)
    loss, reference, counts = reference_load_balancing(moe_folder, [rows[:2], rows[2:]])
    for layer, (with_loss, without, expected) in enumerate(zip(gradients[COEFF], gradients[0.0], reference)):
        error = ((with_loss - without) - COEFF * expected).norm() / (COEFF * expected).norm()
        print(f"\nlayer {layer}: |load-balancing gradient - reference| / |reference| {error.item():.1e} "
              f"(|policy gradient| / |reference| {(without.norm() / (COEFF * expected).norm()).item():.1f})")
        assert error < 1e-3
    share = counts / counts.sum(dim=1, keepdim=True) * EXPERTS
    variation = (counts.std(dim=1, unbiased=False) / counts.mean(dim=1)).mean()
    for figures in updates.values():  # counted whatever the coefficient
        assert figures["moe/aux_loss"] == pytest.approx(loss, rel=1e-6)
        assert figures["moe/expert_load_max"] == pytest.approx(share.max().item(), rel=1e-12)
        assert figures["moe/expert_load_min"] == pytest.approx(share.min().item(), rel=1e-12)
        assert figures["moe/expert_load_cv"] == pytest.approx(variation.item(), rel=1e-12)
    assert 1.0 < loss < 2 * 2  # uneven routing (2 layers: 2 when even), but not all on one expert
    assert updates[COEFF]["loss"] == updates[0.0]["loss"]  # the policy loss alone: the same forward pass


def test_the_load_balancing_gradient_does_not_grow_with_the_micro_batches(moe_folder, world):
    """Rows r1, r2, r1, r2 in one micro-batch or in two (each r1, r2): every micro-batch routes alike, so the loss and
    its gradient are the same. Summed over micro-batches instead of weighted by their tokens (megatron's loss as the
    trainer had it), two micro-batches would double it."""
    aux = {}
    for micro_batch_size in (4, 2):
        gradients = {}
        for coeff in (COEFF, 0.0):
            trainer = moe_trainer(moe_folder, world, micro_batch_size=micro_batch_size, share_prompts=False,
                                  aux_loss_coeff=coeff)
            block = moe_rows(trainer, [4, 8], seed=1)
            [update] = trainer.train_step([block + block])
            gradients[coeff] = router_gradients(trainer)
        aux[micro_batch_size] = ([a - b for a, b in zip(gradients[COEFF], gradients[0.0])], update["moe/aux_loss"])
    (one, loss_one), (two, loss_two) = aux[4], aux[2]
    assert loss_two == pytest.approx(loss_one, rel=1e-6)
    for a, b in zip(one, two):
        assert a.norm() > 1e-4 and ((a - b).norm() / a.norm()) < 1e-3  # 5e-5: the fp32 policy gradient's noise


def test_two_moe_agents_on_one_rank_keep_their_losses_and_figures_apart(moe_folder, world, module_tmp):
    """Agents A (2 layers) and B (3 layers, other weights) in one process, their updates interleaved (A, B, A): A's
    figures and weights are those of A trained alone. megatron's process-wide MoE tracker is never written (with
    megatron's own loss, B's third layer would have indexed past the 2-layer tensor A's routers created there)."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    other = Path(module_tmp("qwen3_moe_3_layers"))
    random_hf_model(tiny_config(num_hidden_layers=3), seed=8).save_pretrained(other)
    a, b = moe_trainer(moe_folder, world, aux_loss_coeff=COEFF), moe_trainer(other, world, aux_loss_coeff=COEFF)
    rows_a, rows_b = moe_rows(a, [3, 5, 7, 9], seed=2), moe_rows(b, [6, 2, 4], seed=3)
    figures_a = a.train_step([rows_a])
    figures_b = b.train_step([rows_b])
    figures_a += a.train_step([rows_a])
    alone = moe_trainer(moe_folder, world, aux_loss_coeff=COEFF)
    figures_alone = alone.train_step([rows_a]) + alone.train_step([rows_a])
    keys = ("moe/aux_loss", "moe/expert_load_max", "moe/expert_load_min", "moe/expert_load_cv", "loss", "grad_norm")
    for mixed, own in zip(figures_a, figures_alone):
        assert {k: mixed[k] for k in keys} == {k: own[k] for k in keys}
    assert figures_b[0]["moe/aux_loss"] != figures_a[0]["moe/aux_loss"]
    assert 1.5 < figures_b[0]["moe/aux_loss"] < 3 * 2  # three layers' losses (3 when even)
    for mine, its in zip(a.ddp_model.module.parameters(), alone.ddp_model.module.parameters()):
        assert torch.equal(mine, its)
    assert dict(get_moe_metrics_tracker().metrics) == {}


def test_a_frozen_router_keeps_its_weights_while_the_experts_train(moe_folder, world):
    from hacpo_megatron.models.moe_router import routers

    trainer = moe_trainer(moe_folder, world, freeze_router=True)
    model = trainer.ddp_model.module
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    [figures] = trainer.train_step([moe_rows(trainer, [3, 5, 7, 9])])
    assert all(not param.requires_grad for router in routers(model) for param in router.parameters())
    changed = {name for name, param in model.named_parameters() if not torch.equal(param, before[name])}
    frozen = {name for name in before if ".mlp.router." in name}
    assert len(frozen) == 2 and not frozen & changed
    assert any(".mlp.experts." in name for name in changed) and any("linear_qkv" in name for name in changed)
    assert math.isfinite(figures["moe/expert_load_cv"])  # still routed and counted
    with pytest.raises(ValueError, match="freeze_router"):
        moe_trainer(moe_folder, world, freeze_router=True, aux_loss_coeff=COEFF)


def test_the_router_keys_are_checked_where_they_are_written(tmp_path):
    from hacpo_megatron.config import ConfigError, load_config

    config = tmp_path / "moe.yaml"
    text = ("run:\n  name: t\nagents:\n  - name: m\n    model: qwen3-moe-tiny\n    tokenizer: qwen3\n    moe:\n"
            "      aux_loss_coeff: {coeff}\n      freeze_router: {freeze}\n  - name: d\n    model: tiny-llama\n{dense}")
    config.write_text(text.format(coeff=0.01, freeze="false", dense=""))
    assert load_config(str(config)).agents[0].moe.aux_loss_coeff == 0.01
    assert load_config(str(config)).agents[1].moe.aux_loss_coeff == 0.0  # the default: no such loss
    config.write_text(text.format(coeff=0, freeze="true", dense=""))
    assert load_config(str(config)).agents[0].moe.freeze_router
    for values, line, message in [
        (dict(coeff=-0.1, freeze="false", dense=""), 8, r"agents\.0\.moe\.aux_loss_coeff: must be >= 0"),
        (dict(coeff=0.01, freeze="true", dense=""), 9, r"agents\.0\.moe\.freeze_router: keeps the routers fixed"),
        (dict(coeff=0, freeze="false", dense="    moe: {aux_loss_coeff: 0.01}\n"), 12,
         r"agents\.1\.moe\.aux_loss_coeff: applies to a mixture-of-experts model's routers; tiny-llama has none"),
    ]:
        config.write_text(text.format(**values))
        with pytest.raises(ConfigError, match=rf"moe\.yaml:{line}: {message}"):
            load_config(str(config))


# ------------------------------------------------------------------------------------------------
# (f) routing replay per model (issue 52, item 4; docs/moe.md): forced routes reach the right tokens however rows are
# packed (against transformers routed the same way, one sequence at a time), R2's recorded routes replay in the
# updates, R3's engine routes in the pass and the updates, two MoE agents in one process keep their routes apart, and
# the engine-vs-trainer figures of off / r2 / r3
# ------------------------------------------------------------------------------------------------
LAYERS = 2


def random_routes(sequences, layers=LAYERS, seed=0):
    """Per sequence [tokens, layers, k]: k distinct experts drawn at random for every token and layer; one prompt's
    tokens take the same routes in all its sequences (as they do in a pass, and in an engine up to its numerics)."""
    g = torch.Generator().manual_seed(seed)

    def draw(n):
        return torch.rand(n, layers, EXPERTS, generator=g).argsort(dim=-1)[..., :TOP_K].to(torch.int16)

    prompts = {}
    return [torch.cat([prompts.setdefault(tuple(p), draw(len(p))), draw(len(r))]) for p, r in sequences]


def hf_model_of(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                             experts_implementation="eager").eval()


@torch.no_grad()
def hf_forced_logprobs(hf, sequences, routes, temperature):
    """transformers' log-probs of each sequence alone, its routers taking the given experts (-1: their own top-k),
    the routing weights those experts' renormalised probabilities (Qwen3-MoE's norm_topk_prob)."""
    from tests.models.workers.reference import hf_token_logprobs

    gates = [layer.mlp.gate for layer in hf.model.layers]
    out = []
    for sequence, route in zip(sequences, routes):
        for layer, gate in enumerate(gates):
            gate.forward = functools.partial(_forced_gate, gate, route[:, layer].long())
        try:
            out += hf_token_logprobs(hf, [sequence], temperature)
        finally:
            for gate in gates:
                del gate.forward
    return out


def _forced_gate(gate, forced, hidden):
    hidden = hidden.reshape(-1, gate.hidden_dim)
    logits = torch.nn.functional.linear(hidden, gate.weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    indices = torch.where(forced >= 0, forced, probs.topk(gate.top_k, dim=-1).indices)
    weights = probs.gather(1, indices)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(logits.dtype), indices


def worst(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def rows_of(result):
    return [result.token_logprobs[i, :int(n)] for i, n in enumerate(result.lengths)]


@pytest.mark.parametrize("packing", [dict(max_tokens_per_micro_batch=24), dict(share_prompts=True),
                                     dict(max_sequences_per_micro_batch=3)],
                         ids=["packed", "shared_prompts", "padded_rows"])
def test_forced_routes_reach_their_tokens_however_rows_are_packed(moe_folder, world, packing):
    """Random routes (far from the model's own) replayed in the trainer's pass give transformers' log-probs of each
    sequence alone routed the same way; the pass records exactly those routes. The same routes given to the wrong
    sequences (two of equal length swapped), or not replayed, give other log-probs: the comparison would catch a
    route meeting the wrong row or position."""
    from hacpo_megatron.models.logprobs import compute_sequence_logprobs
    from hacpo_megatron.models.moe_replay import RouteReplay
    from tests.models.workers.reference import SHARED_PROMPT_SEQUENCES, TEMPERATURE

    sequences = SHARED_PROMPT_SEQUENCES
    routes = random_routes(sequences)
    agent = build_from_folder(moe_folder, world)
    replay = RouteReplay(agent.model)
    live = compute_sequence_logprobs(agent, sequences, temperature=TEMPERATURE, **packing)
    replay.keep(sequences, routes)
    forced = compute_sequence_logprobs(agent, sequences, temperature=TEMPERATURE, route_replay=replay, **packing)
    hf = hf_model_of(moe_folder)
    reference = hf_forced_logprobs(hf, sequences, routes, TEMPERATURE)
    error, moved = worst(rows_of(forced), reference), worst(rows_of(live), reference)
    print(f"\nforced routes: max |trainer - transformers| {error:.1e}; live routing is {moved:.2f} away")
    assert error < TOLERANCE and moved > 0.1
    for recorded, route in zip(forced.routes, routes):
        assert torch.equal(recorded.sort(dim=-1).values, route.sort(dim=-1).values)
    swapped = list(routes)
    a, b = 0, 2  # ([21..25], [30, 31, 32]) and ([7, 8], [40..45]): 8 tokens each; their answers' routes swapped
    swapped[a] = torch.cat([routes[a][:5], routes[b][2:5]])
    swapped[b] = torch.cat([routes[b][:2], routes[a][5:], routes[b][5:]])
    replay.clear()
    replay.keep(sequences, swapped)
    wrong = compute_sequence_logprobs(agent, sequences, temperature=TEMPERATURE, route_replay=replay, **packing)
    assert max((rows_of(wrong)[i] - reference[i]).abs().max().item() for i in (a, b)) > 0.1


def engine_answers(folder, dtype, prompts, max_new_tokens=12):
    """The embedded engine (transformers, `dtype`) sampling from the model saved in `folder`, routes recorded."""
    from hacpo_megatron.rollout.base import SamplingParams
    from hacpo_megatron.rollout.embedded import EmbeddedEngine

    class Silent:
        def decode(self, ids, skip_special_tokens=True):
            return ""

    engine = EmbeddedEngine(hf_model_of(folder).to(dtype), Silent(), eos_token_ids=[1], pad_token_id=0,
                            record_routes=True)
    groups = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=max_new_tokens, seed=3))
    return [c for group in groups for c in group]


def test_the_embedded_engine_records_the_routes_it_took(moe_folder):
    """Each answer's routes: the prompt's and the fed answer tokens' (the last one never fed: -1), equal to what
    transformers' routers pick for the whole sequence in one forward without a cache."""
    prompts = [[5, 6, 7, 8, 9], [300, 301, 302]]
    answers = engine_answers(moe_folder, torch.float32, prompts)
    hf = hf_model_of(moe_folder)
    seen = []
    handles = [layer.mlp.gate.register_forward_hook(lambda _m, _i, output: seen.append(output[2]))
               for layer in hf.model.layers]
    try:
        for index, answer in enumerate(answers):
            prompt = prompts[index // 2]
            assert answer.routes.shape == (len(prompt) + len(answer.token_ids), LAYERS, TOP_K)
            assert (answer.routes[-1] == -1).all() and (answer.routes[:-1] >= 0).all()
            seen.clear()
            with torch.no_grad():
                hf(torch.tensor([prompt + answer.token_ids]))
            full = torch.stack(seen, dim=1)[:-1]
            assert torch.equal(full.sort(dim=-1).values, answer.routes[:-1].long().sort(dim=-1).values)
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("engine_dtype", [torch.float32, torch.bfloat16], ids=["fp32_engine", "bf16_engine"])
def test_r3_routes_the_trainer_as_the_engine_did(moe_folder, world, engine_dtype):
    """The gap table of docs/moe.md: engine vs trainer per-token log-prob gap on the agent's own answers and the
    fraction of (token, layer) top-k sets where the trainer's routes differ from the engine's, for off / r2 / r3.
    r2's old-log-prob pass routes live (it records the routes it takes), so its figures are off's; r3 replays the
    engine's routes: no differing set. Weights identical; in bf16 the engine's numerics differ from the trainer's
    fp32, as a GPU engine's do."""
    from hacpo_megatron.models.moe_replay import top_k_sets_differ
    from hacpo_megatron.training.step_data import own_sequences

    prompt_ids = [list(range(10 + 7 * b, 17 + 7 * b)) for b in range(4)]
    answers = engine_answers(moe_folder, engine_dtype, prompt_ids, max_new_tokens=16)
    sequences = own_sequences(prompt_ids, [answers[2 * b:2 * b + 2] for b in range(len(prompt_ids))])
    figures = {}
    for mode in ("off", "r2", "r3"):
        trainer = moe_trainer(moe_folder, world, routing_replay=mode)
        trainer.begin_step_routes(sequences, [a.routes for a in answers])
        old = trainer.sequence_logprobs(sequences)
        gaps = torch.cat([(torch.tensor(a.logprobs) - old.token_logprobs[i, :len(a.logprobs)]).abs()
                          for i, a in enumerate(answers)])
        figures[mode] = dict(gap_max=gaps.max().item(), gap_mean=gaps.mean().item())
        if mode != "off":  # the routes the pass took, against the engine's, where the engine fed the token
            differ = torch.cat([top_k_sets_differ(route[:-1].long(), a.routes[:-1].long()).flatten()
                                for route, a in zip(old.routes, answers)])
            figures[mode]["route_differs"] = differ.double().mean().item()
    figures["off"]["route_differs"] = figures["r2"]["route_differs"]  # r2's pass is live: off's routes
    print(f"\n{engine_dtype}: " + "; ".join(
        f"{mode}: gap max {f['gap_max']:.2e} mean {f['gap_mean']:.2e}, top-k sets differing "
        f"{100 * f['route_differs']:.2f} %" for mode, f in figures.items()))
    assert figures["r3"]["route_differs"] == 0.0
    assert figures["r2"]["gap_max"] == figures["off"]["gap_max"]
    if engine_dtype == torch.bfloat16:  # the numerics differ: some near ties route the other way live
        assert figures["off"]["route_differs"] > 0
        assert figures["r3"]["gap_max"] < figures["off"]["gap_max"]


class LogProbSpy:
    """The trainer's policy loss, keeping each micro-batch's per-row mean log-prob minus its old one."""

    def __init__(self, loss):
        self.loss, self.log_ratios = loss, []

    def __getattr__(self, name):
        return getattr(self.loss, name)

    def __call__(self, batch, params):
        mean = (batch.logp * batch.mask).sum(dim=1) / batch.mask.sum(dim=1)
        self.log_ratios.append((mean - batch.old_seq_logp).detach())
        return self.loss(batch, params)


def first_update_log_ratio(trainer, rows):
    spy = trainer.policy_loss = LogProbSpy(trainer.policy_loss)
    trainer.train_step([rows])
    return torch.cat(spy.log_ratios).abs().max().item()


def test_replay_in_the_update_gives_the_old_passes_log_probs(moe_folder, world):
    """On-policy, the first update's log-probs are the old-log-prob pass's: with r2 (the pass's routes replayed) and
    r3 (the engine's, here forced at random so that live routing is far from them). Without replay in the update
    (off, given the same forced old log-probs), the ratio moves far from 1. The update packs its rows otherwise than
    the pass (micro-batches of 2 rows, not by length), so rows meet their routes by their tokens."""
    figures = {}
    for mode in ("r2", "r3", "off"):
        trainer = moe_trainer(moe_folder, world, micro_batch_size=2, routing_replay=mode)
        probe = moe_rows(trainer, [3, 5, 7, 9], seed=4)  # the sequences; old log-probs computed again below
        sequences = [(r.prompt_ids, r.response_ids) for r in probe]
        trainer.begin_step_routes(sequences, random_routes(sequences, seed=9))
        if mode == "off":  # the forced pass's old log-probs, from an r3 trainer of the same weights
            forcing = moe_trainer(moe_folder, world, routing_replay="r3")
            forcing.begin_step_routes(sequences, random_routes(sequences, seed=9))
            old = forcing.sequence_logprobs(sequences)
        else:
            old = trainer.sequence_logprobs(sequences)
            assert len(trainer.route_replay) == len(sequences)
        rows = [type(r)(**{**r.__dict__, "old_seq_logp": float(old.sums[i] / old.lengths[i])})
                for i, r in enumerate(probe)]
        figures[mode] = first_update_log_ratio(trainer, rows[::-1])  # another order than the pass's
        if mode != "off":
            assert len(trainer.route_replay) == 0  # the step's routes are forgotten after its updates
    print(f"\nfirst update's max |log ratio| per row: {figures}")
    assert figures["r2"] < 1e-5 and figures["r3"] < 1e-5 and figures["off"] > 1e-2


def test_two_moe_agents_on_one_rank_keep_their_routes_apart(moe_folder, world, module_tmp):
    """Agents A (2 layers) and B (3 layers) in one process, both replaying, their passes and updates interleaved
    (A's pass, B's pass, A's update, B's update): A's kept routes, update figures and weights are exactly those of A
    alone, B's routes are B's; megatron's process-wide RouterReplay list stays empty."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    other = Path(module_tmp("qwen3_moe_replay_3_layers"))
    random_hf_model(tiny_config(num_hidden_layers=3), seed=8).save_pretrained(other)

    def a_pass(trainer):
        rows = moe_rows(trainer, [3, 5, 7, 9], seed=2)
        return rows, {key: value.clone() for key, value in trainer.route_replay._store.items()}

    a, b = moe_trainer(moe_folder, world, routing_replay="r2"), moe_trainer(other, world, routing_replay="r3")
    rows_a, kept_a = a_pass(a)
    b_sequences = [([3, 4, 5], [6, 7]), ([3, 4, 5], [8, 9, 10])]
    b.begin_step_routes(b_sequences, random_routes(b_sequences, layers=3, seed=5))
    old_b = b.sequence_logprobs(b_sequences)
    rows_b = [type(rows_a[0])(prompt_ids=p, response_ids=r, advantage=1.0 - 2 * i, is_cross=False, source=0,
                              prompt_index=i, old_seq_logp=float(old_b.sums[i] / old_b.lengths[i]))
              for i, (p, r) in enumerate(b_sequences)]
    assert set(a.route_replay._store) == {(tuple(r.prompt_ids), tuple(r.response_ids)) for r in rows_a}
    assert {route.shape[1] for route in a.route_replay._store.values()} == {2}
    assert {route.shape[1] for route in b.route_replay._store.values()} == {3}
    figures_a = a.train_step([rows_a])
    b.train_step([rows_b])
    alone = moe_trainer(moe_folder, world, routing_replay="r2")
    rows_alone, kept_alone = a_pass(alone)
    assert kept_a.keys() == kept_alone.keys() and all(torch.equal(kept_a[k], kept_alone[k]) for k in kept_a)
    figures_alone = alone.train_step([rows_alone])
    keys = ("loss", "grad_norm", "own_ratio_mean", "moe/expert_load_max", "moe/expert_load_cv")
    assert {k: figures_a[0][k] for k in keys} == {k: figures_alone[0][k] for k in keys}
    for mine, its in zip(a.ddp_model.module.parameters(), alone.ddp_model.module.parameters()):
        assert torch.equal(mine, its)
    assert RouterReplay.global_router_replay_instances == []


def test_a_pipeline_stage_keeps_its_own_layers_routes_and_router_sums(moe_folder, world):
    """At PP > 1 a stage holds some of the model's layers (tests/models/test_moe_pipeline.py runs them). Each layer of
    a PP 1 model taken as a stage: its RouteReplay keeps its own layer of the engine's whole-model routes, and its
    RouterLoad's sums sit at its layer's place, zeros elsewhere, so that the stages' sums add up to the model's
    exactly (what the trainer's sum over the pipeline does)."""
    from hacpo_megatron.models.moe_replay import RouteReplay
    from hacpo_megatron.models.moe_router import RouterLoad, router_metrics, routers

    agent = build_from_folder(moe_folder, world)
    layers = list(agent.model.decoder.layers)
    sequences = [([3, 4, 5], [6, 7]), ([3, 4, 5], [8, 9, 10])]
    whole_routes = random_routes(sequences, seed=4)
    for index, layer in enumerate(layers):
        replay = RouteReplay(layer)
        assert (replay.num_layers, replay.model_layers, replay.layers) == (1, LAYERS, [index])
        replay.keep(sequences, whole_routes)
        for sequence, route in zip(sequences, whole_routes):
            assert torch.equal(replay.routes_of(*sequence), route[:, [index]])
        replay.keep(sequences[:1], [whole_routes[0][:, [index]]])  # a pass's routes: the stage's layer already
        assert torch.equal(replay.routes_of(*sequences[0]), whole_routes[0][:, [index]])
        for router in routers(layer):
            router.router_replay = None  # the layer's router back as it was

    tokens = tokens_batch()
    model_load, stage_loads = RouterLoad(agent.model), [RouterLoad(layer) for layer in layers]
    assert [load.layers for load in stage_loads] == [[0], [1]] and model_load.layers == [0, 1]
    for load in (model_load, *stage_loads):
        load.begin_update(tokens.numel())
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    agent.model.train()
    with torch.enable_grad():
        agent.model(tokens, positions, attention_mask=None)
    whole, parts = model_load.end_update(), [load.end_update() for load in stage_loads]
    E = EXPERTS
    for index, part in enumerate(parts):
        mine = torch.zeros_like(part, dtype=torch.bool)
        mine[index * E:(index + 1) * E] = True
        mine[LAYERS * E + index] = mine[LAYERS * E + LAYERS + index] = True
        assert not part[~mine].any() and part[mine].any()
    assert torch.equal(parts[0] + parts[1], whole)
    figures = router_metrics(whole, model_load.num_layers, E)
    assert all(value == value for value in figures.values())  # every layer routed: no NaN
    for load in (model_load, *stage_loads):
        load.remove()


def test_the_routing_replay_key_is_checked_where_it_is_written(tmp_path):
    from hacpo_megatron.config import ConfigError, load_config

    config = tmp_path / "moe.yaml"
    text = ("run:\n  name: t\n{run}rollout:\n  old_logprobs: {old}\nagents:\n  - name: m\n    model: qwen3-moe-tiny\n"
            "    tokenizer: qwen3\n    engine: {engine}\n    moe:\n      routing_replay: {mode}\n"
            "  - name: d\n    model: tiny-llama\n{dense}")
    ok = dict(run="", old="trainer", engine="embedded", mode="r3", dense="")
    config.write_text(text.format(**ok))
    cfg = load_config(str(config))
    assert cfg.agents[0].moe.routing_replay == "r3" and cfg.agents[1].moe.routing_replay == "off"
    config.write_text(text.format(**dict(ok, mode="off")))  # YAML 1.1 reads an unquoted off as false
    assert load_config(str(config), ["agents.m.moe.routing_replay=r2"]).agents[0].moe.routing_replay == "r2"
    assert load_config(str(config)).agents[0].moe.routing_replay == "off"
    assert load_config(str(config), ["agents.m.moe.routing_replay=off"]).agents[0].moe.routing_replay == "off"
    for changes, line, message in [
        (dict(mode="r4"), 11, r"agents\.0\.moe\.routing_replay: "),
        (dict(engine="sglang"), 11, r"agents\.0\.moe\.routing_replay: r3 replays the engine's routes, which only"),
        (dict(engine="vllm", mode="r2"), 9, r"agents\.0\.engine: vllm with a mixture-of-experts model "
                                             r"\(qwen3-moe-tiny\) is not supported here"),
        (dict(run="  mode: train_only\n"), 12, r"agents\.0\.moe\.routing_replay: r3 replays the engine's routes; "
                                               r"run\.mode train_only"),
        (dict(mode="r2", old="engine"), 11, r"agents\.0\.moe\.routing_replay: r2 replays the routes of the trainer"),
        (dict(dense="    moe: {routing_replay: r2}\n"), 14,
         r"agents\.1\.moe\.routing_replay: applies to a mixture-of-experts model's routers; tiny-llama has none"),
    ]:
        config.write_text(text.format(**{**ok, **changes}))
        with pytest.raises(ConfigError, match=rf"moe\.yaml:{line}: {message}"):
            load_config(str(config))
