import pytest

from hacpo_megatron.data import PromptSampler
from hacpo_megatron.data.records import PromptRecord, user_prompt

DATASET = [PromptRecord(f"p{i}", user_prompt(f"q{i}"), str(i), "test") for i in range(10)]


def uids(batch):
    return [record.uid for record in batch]


def test_epochs_cover_everything_once_and_reshuffle():
    sampler = PromptSampler(DATASET, batch_size=5, seed=3)
    epoch0 = uids(sampler.next_batch()) + uids(sampler.next_batch())
    epoch1 = uids(sampler.next_batch()) + uids(sampler.next_batch())
    assert sorted(epoch0) == sorted(epoch1) == sorted(r.uid for r in DATASET)
    assert epoch0 != epoch1
    assert sampler.epoch == 1


def test_batches_span_epoch_boundaries():
    sampler = PromptSampler(DATASET, batch_size=4, seed=0)
    batches = [uids(sampler.next_batch()) for _ in range(5)]  # 20 prompts: exactly two epochs
    assert all(len(b) == 4 for b in batches)
    flat = sum(batches, [])
    assert sorted(flat[:10]) == sorted(flat[10:]) == sorted(r.uid for r in DATASET)


def test_same_seed_same_batches_different_seed_different():
    first = [uids(b) for b, _ in zip(PromptSampler(DATASET, 3, seed=1), range(8))]
    again = [uids(b) for b, _ in zip(PromptSampler(DATASET, 3, seed=1), range(8))]
    other = [uids(b) for b, _ in zip(PromptSampler(DATASET, 3, seed=2), range(8))]
    assert first == again != other


@pytest.mark.parametrize("stop_after", [0, 1, 3, 4, 7])
def test_resume_gives_identical_batches(stop_after):
    reference = PromptSampler(DATASET, batch_size=3, seed=11)
    expected = [uids(reference.next_batch()) for _ in range(12)]
    sampler = PromptSampler(DATASET, batch_size=3, seed=11)
    seen = [uids(sampler.next_batch()) for _ in range(stop_after)]
    state = sampler.state_dict()
    resumed = PromptSampler(DATASET, batch_size=3, seed=11)
    resumed.load_state_dict(dict(state))
    seen += [uids(resumed.next_batch()) for _ in range(12 - stop_after)]
    assert seen == expected


def test_refuses_state_of_another_dataset_or_seed():
    state = PromptSampler(DATASET, 2, seed=1).state_dict()
    with pytest.raises(ValueError, match="num_prompts=10 but this sampler has num_prompts=9"):
        PromptSampler(DATASET[:9], 2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=1 but this sampler has seed=2"):
        PromptSampler(DATASET, 2, seed=2).load_state_dict(state)


def test_no_shuffle_keeps_file_order():
    sampler = PromptSampler(DATASET, batch_size=4, seed=0, shuffle=False)
    assert uids(sampler.next_batch()) == ["p0", "p1", "p2", "p3"]


def test_rejects_empty_dataset_and_bad_batch_size():
    with pytest.raises(ValueError, match="empty"):
        PromptSampler([], 2, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        PromptSampler(DATASET, 0, seed=0)
