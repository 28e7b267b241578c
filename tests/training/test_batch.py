import pytest

from hacpo_megatron.training.batch import SequenceRow, data_parallel_shard, micro_batches, mini_batches


def row(b, source=0, length=2):
    return SequenceRow(prompt_ids=[1, 2], response_ids=[3] * length, advantage=0.5, old_seq_logp=-1.0,
                       is_cross=source != 0, source=source, prompt_index=b)


def test_mini_batches_group_all_rows_of_a_prompt_block():
    rows = [row(b, s) for s in (0, 1) for b in range(4) for _ in range(2)]
    batches = mini_batches(rows, num_prompts=4, prompts_per_mini_batch=2)
    assert len(batches) == 2
    assert {r.prompt_index for r in batches[0]} == {0, 1} and {r.prompt_index for r in batches[1]} == {2, 3}
    assert sum(len(b) for b in batches) == len(rows)
    assert {r.source for r in batches[1]} == {0, 1}
    with pytest.raises(ValueError, match="must divide"):
        mini_batches(rows, num_prompts=4, prompts_per_mini_batch=3)


@pytest.mark.parametrize("n,dp", [(10, 3), (4, 4), (3, 4), (0, 2), (7, 1)])
def test_data_parallel_shards_cover_every_row_once_and_differ_by_at_most_one(n, dp):
    rows = [row(i % 4) for i in range(n)]
    shards = [data_parallel_shard(rows, r, dp) for r in range(dp)]
    flat = [id(x) for s in shards for x in s]
    assert flat == [id(x) for x in rows]
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1


def test_micro_batches_and_row_checks():
    rows = [row(0) for _ in range(7)]
    assert [len(m) for m in micro_batches(rows, 3)] == [3, 3, 1]
    with pytest.raises(ValueError, match="empty response"):
        row(0, length=0)
    with pytest.raises(ValueError, match="one entry per response token"):
        SequenceRow([1], [2, 3], 0.0, -1.0, False, 0, 0, old_token_logp=[-1.0])
