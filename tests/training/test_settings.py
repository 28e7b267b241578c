"""training/settings.py: each part's settings resolved once from the config; G and G' kept apart."""
from hacpo_megatron.algorithms.registry import algorithm_spec
from hacpo_megatron.config import load_config
from hacpo_megatron.orchestrator.rollout_pipeline import sampling
from hacpo_megatron.training.settings import run_settings

AGENTS = "agents=[{name: a, model: tiny-qwen3, tokenizer: qwen3}, {name: b, model: tiny-llama, tokenizer: llama3.2}]"


def resolved(*overrides):
    cfg = load_config(None, [AGENTS, "rollout.samples_per_prompt=4", "data.prompt_batch_size=8",
                             "train.mini_batch_size=4", *overrides])
    return cfg, run_settings(cfg, algorithm_spec(cfg.algorithm), weight_check=False)


def test_gspo_x2_answers_2g_per_prompt_while_an_update_still_counts_prompts_of_g():
    _, settings = resolved("algorithm.name=gspo_x2")
    assert settings.answers_per_prompt == settings.generation.answers_per_prompt == 8  # G' = 2G
    assert settings.learners.answers_per_prompt == 8 and sampling(settings.generation, 3)(1).n == 8
    assert settings.learners.rows_per_update == 4 * 4  # train.mini_batch_size x G
    _, settings = resolved()
    assert settings.answers_per_prompt == 4 and settings.learners.rows_per_update == 16


def test_each_agents_engine_and_the_evaluation_are_resolved_from_its_own_keys():
    cfg, settings = resolved("agents.1.tokenizer=null", "agents.1.init_from=null", "run.seed=7")
    assert [e.tokenizer for e in settings.actors.engines] == ["qwen3", "tiny-llama"]  # AgentConfig.tokenizer_source
    assert [e.seed for e in settings.actors.engines] == [7, 8]
    held_out = settings.generation.held_out
    assert (held_out.n, held_out.greedy, held_out.seed) == (cfg.data.eval_samples, cfg.data.eval_greedy, 7 + 99_991)


def test_the_engines_log_probs_are_checked_against_the_algorithms_own_clip_only_when_asked_for():
    assert resolved()[1].learners.engine_logprob_clip is None
    assert resolved("rollout.old_logprobs=engine")[1].learners.engine_logprob_clip == 3e-4  # GSPO's clip_low
    assert resolved("algorithm.name=grpo", "rollout.old_logprobs=engine")[1].learners.engine_logprob_clip == 0.2
