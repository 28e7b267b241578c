"""reasoning-gym's generators as a prompt source (data/reasoning_gym.py), read back through reasoning-gym itself."""
import pytest

from hacpo_megatron.data import load_prompts
from hacpo_megatron.data.reasoning_gym import parse_spec
from hacpo_megatron.data.synthetic import split_of



def test_a_generator_gives_seeded_disjoint_splits_with_its_own_answers():
    import reasoning_gym

    train = load_prompts("reasoning_gym:gsm_symbolic?size=40&seed=3", "train")
    held_out = load_prompts("reasoning_gym:gsm_symbolic?size=20&seed=3", "eval")
    assert len(train) == 40 and len(held_out) == 20
    assert not {r.question for r in train} & {r.question for r in held_out}  # never the same question
    assert len({r.question for r in train}) == 40  # no repeats within a split
    assert all(split_of(r.question) == "train" for r in train)
    # each problem is reasoning-gym's item at its index, from the split's seed (eval: seed + 1), with its answer
    for records, seed in ((train, 3), (held_out, 4)):
        dataset = reasoning_gym.create_dataset("gsm_symbolic", size=records[-1].extra_info["index"] + 1, seed=seed)
        for r in records:
            item = dataset[r.extra_info["index"]]
            assert (r.extra_info["seed"] == seed and r.question == item["question"]
                    and r.ground_truth == str(item["answer"]))
            assert dataset.score_answer(r.ground_truth, item) == 1.0
    assert train[0].data_source == "reasoning_gym:gsm_symbolic" and train[0].messages[0]["role"] == "user"
    # the same spec, the same problems in the same order; another seed, others
    assert [r.uid for r in load_prompts("reasoning_gym:gsm_symbolic?size=40&seed=3", "train")] == [r.uid for r in train]
    other = load_prompts("reasoning_gym:gsm_symbolic?size=40&seed=5", "train")
    assert [r.question for r in other] != [r.question for r in train]


def test_generator_settings_reach_the_generator():
    records = load_prompts("reasoning_gym:chain_sum?size=30&min_terms=4&max_terms=4&min_digits=1&max_digits=1", "train")
    assert all(r.question.count("+") + r.question.count(" - ") == 3 for r in records)  # four terms, three operators
    assert parse_spec("reasoning_gym:chain_sum?size=3&allow_negation=true&x=0.5&y=ab") == (
        "chain_sum", {"size": 3}, {"allow_negation": True, "x": 0.5, "y": "ab"})


@pytest.mark.parametrize("spec,message", [
    ("reasoning_gym:gsm_symbolik", "no generator 'gsm_symbolik'; did you mean gsm_symbolic"),
    ("reasoning_gym:chain_sum?min_termz=3",
     "generator 'chain_sum' has no setting 'min_termz'; its settings: size, seed,"),
    ("reasoning_gym:chain_sum?size=0", "size must be an integer >= 1"),
    ("reasoning_gym:chain_sum?min_terms=9&max_terms=2", "generator 'chain_sum' refused its settings"),
])
def test_bad_specs_are_named(spec, message):
    with pytest.raises(ValueError) as error:
        load_prompts(spec, "train")
    assert message in str(error.value) and spec in str(error.value)
