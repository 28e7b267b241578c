import pytest

from hacpo_megatron.training.batch import (
    SequenceRow, UpdateSchedule, data_parallel_shard, micro_batches, mini_batches,
)


def row(b, source=0, length=2, i=0):
    return SequenceRow(prompt_ids=[1, 2], response_ids=[3] * length, advantage=0.5, old_seq_logp=-1.0,
                       is_cross=source != 0, source=source, prompt_index=b, sample_index=i)


def grid_rows(sources, B, G):
    """A learner's rows as learner_rows lays them out: source by source, then prompt, then sample."""
    return [row(b, s, i=i) for s in sources for b in range(B) for i in range(G)]


@pytest.mark.parametrize("algorithm,sources,samples,expected_updates", [
    ("hacpo", (0, 1), 8, 4), ("naive", (0, 1), 8, 4), ("gspo", (0,), 8, 2), ("grpo", (0,), 8, 2),
    ("gspo_x2", (0,), 16, 4), ("hacpo, three agents", (0, 1, 2), 8, 6)])
def test_every_update_sees_mini_batch_size_times_G_responses_as_in_the_paper(algorithm, sources, samples,
                                                                             expected_updates):
    B, mini, G = 128, 64, 8  # the paper's batch, mini-batch and G
    schedule = UpdateSchedule(B, samples, sources, rows_per_update=mini * G)
    rows = grid_rows(sources, B, samples)
    batches = mini_batches(rows, schedule)
    assert schedule.num_updates == len(batches) == expected_updates
    assert all(len(batch) == mini * G for batch in batches)  # 512 responses per update, every algorithm
    assert sorted(map(id, (r for batch in batches for r in batch))) == sorted(map(id, rows))
    if len(sources) > 1:  # own and other agents' answers to the same prompts, in every update
        for batch in batches:
            assert {r.source for r in batch} == set(sources)
            by_prompt = {}
            for r in batch:
                by_prompt.setdefault(r.prompt_index, set()).add(r.source)
            assert sum(sources == tuple(sorted(s)) for s in by_prompt.values()) >= len(by_prompt) - 2


def test_two_agents_make_prompt_blocks_with_all_their_rows_interleaved():
    rows = grid_rows((0, 1), B=4, G=2)
    batches = mini_batches(rows, UpdateSchedule(4, 2, (0, 1), rows_per_update=2 * 2))
    assert [sorted({r.prompt_index for r in b}) for b in batches] == [[0], [1], [2], [3]]
    assert [(r.sample_index, r.source) for r in batches[0]] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_a_dropped_bridged_answer_shortens_its_update_and_moves_nothing():
    rows = grid_rows((0, 1), B=4, G=2)
    schedule = UpdateSchedule(4, 2, (0, 1), rows_per_update=4)
    full = mini_batches(rows, schedule)
    dropped = [r for r in rows if not (r.source == 1 and r.prompt_index == 2 and r.sample_index == 0)]
    batches = mini_batches(dropped, schedule)
    assert [len(b) for b in batches] == [4, 4, 3, 4]
    assert [b for k, b in enumerate(batches) if k != 2] == [b for k, b in enumerate(full) if k != 2]
    assert mini_batches([r for r in rows if r.prompt_index != 1 or r.source == 0],
                        schedule)[1] == [r for r in full[1] if r.source == 0]


def test_schedule_rejects_what_does_not_divide_and_rows_outside_the_grid():
    with pytest.raises(ValueError, match="must divide"):
        UpdateSchedule(4, 2, (0, 1), rows_per_update=3)
    schedule = UpdateSchedule(4, 2, (0,), rows_per_update=4)
    with pytest.raises(ValueError, match="not among the learner's sources"):
        mini_batches([row(0, source=1)], schedule)
    with pytest.raises(ValueError, match="outside the step"):
        mini_batches([row(4)], schedule)
    with pytest.raises(ValueError, match="outside the step"):
        mini_batches([row(0, i=2)], schedule)


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
