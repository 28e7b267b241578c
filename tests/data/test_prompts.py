import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hacpo_megatron.data import DataFormatError, load_prompts

VERL_ROW = {
    "data_source": "gsm8k",
    "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}],
    "reward_model": {"style": "rule", "ground_truth": "4"},
    "extra_info": {"index": 7},
}


def write_jsonl(path, rows, raw_lines=()):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + "".join(raw_lines))
    return path


def test_verl_jsonl(tmp_path):
    records = load_prompts(str(write_jsonl(tmp_path / "train.jsonl", [VERL_ROW, VERL_ROW])))
    assert len(records) == 2
    record = records[0]
    assert record.messages == VERL_ROW["prompt"]
    assert record.question == "What is 2 + 2?"
    assert (record.ground_truth, record.data_source, record.extra_info) == ("4", "gsm8k", {"index": 7})
    assert [r.uid for r in records] == ["train-0", "train-1"]


def test_plain_forms(tmp_path):
    rows = [
        {"question": "2+2?", "answer": "4"},
        {"problem": "Half of one?", "solution": "It is $\\frac{1}{2}$, so \\boxed{\\frac{1}{2}}."},
        {"question": "Sum?", "answer": "First 1+1=2.\n#### 1,002"},
        {"question": "Int?", "answer": 12, "uid": "q-12"},
    ]
    records = load_prompts(str(write_jsonl(tmp_path / "plain.jsonl", rows)))
    assert [r.ground_truth for r in records] == ["4", "\\frac{1}{2}", "1002", "12"]
    assert records[1].messages == [{"role": "user", "content": "Half of one?"}]
    assert records[0].data_source == "plain" and records[3].uid == "q-12"


def test_parquet(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([VERL_ROW, {**VERL_ROW, "reward_model": {"ground_truth": "5"}}]), path)
    records = load_prompts(str(path))
    assert [r.ground_truth for r in records] == ["4", "5"]
    assert records[0].messages[1]["content"] == "What is 2 + 2?"


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("{not json\n", "line 3: invalid JSON"),
        ("[1, 2]\n", "line 3: expected a JSON object"),
        (json.dumps({"prompt": "q", "reward_model": {}}) + "\n",
         "line 3: verl row needs 'reward_model'.*; row has keys \\['prompt', 'reward_model'\\]$"),
        (json.dumps({"prompt": "q", "answer": "1"}) + "\n",  # a common hand-written form: say what would read it
         "line 3: verl row needs .*row has keys \\['answer', 'prompt'\\] \\(for a plain row with 'answer', name its "
         "prompt 'question'\\)"),
        (json.dumps({"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "1"}}) + "\n",
         "line 3: 'prompt'\\[0\\]"),
        (json.dumps({"question": "q"}) + "\n", "line 3: no answer"),
        (json.dumps({"text": "q", "answer": "1"}) + "\n", "line 3: no question.*row has keys \\['answer', 'text'\\]"),
        (json.dumps({"problem": "q", "solution": "long\nworked solution"}) + "\n",
         "line 3: field 'solution' holds a worked"),
        (json.dumps({"question": "q", "answer": "\\boxed{1"}) + "\n", "line 3: field 'answer' has an unclosed"),
        (json.dumps({**VERL_ROW, "extra_info": [7]}) + "\n", "line 3: 'extra_info' must be an object, got list"),
        (json.dumps({**VERL_ROW, "prompt": [{"role": "system", "content": "s"}]}) + "\n",
         "line 3: 'prompt' has no user message"),
    ],
)
def test_bad_jsonl_row_names_file_and_line(tmp_path, bad_line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [VERL_ROW], raw_lines=["\n", bad_line])  # line 2 is blank
    with pytest.raises(DataFormatError, match=message) as error:
        load_prompts(str(path))
    assert str(error.value).startswith(f"{path}:line 3: ")  # the file and the line, in the order an editor reads


def test_bytes_that_are_not_utf8_name_file_line_and_column(tmp_path):
    # a Latin-1 "é" (0xe9) in line 2: decoding it leniently would load the row with U+FFFD in its question
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(VERL_ROW).encode() + b'\n{"question": "caf\xe9?", "answer": "1"}\n')
    with pytest.raises(DataFormatError) as error:
        load_prompts(str(path))
    # column 18: '{"question": "caf' is 17 characters, the bad byte the 18th
    assert str(error.value) == f"{path}:line 2: not UTF-8 text (byte 0xe9 at column 18)"


def test_bad_parquet_row_names_row_index(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "a", "answer": "1"}, {"question": "b", "answer": None}]), path)
    with pytest.raises(DataFormatError, match=r"bad.parquet:row 1: no answer"):
        load_prompts(str(path))


def test_missing_or_unknown_file(tmp_path):
    with pytest.raises(DataFormatError, match="no such file") as error:
        load_prompts(str(tmp_path / "none.jsonl"))
    assert str(error.value) == f"{tmp_path / 'none.jsonl'}: no such file"
    (tmp_path / "data.csv").write_text("question,answer\n")
    with pytest.raises(DataFormatError, match="unknown file type '.csv'") as error:
        load_prompts(str(tmp_path / "data.csv"))
    assert str(error.value).startswith(f"{tmp_path / 'data.csv'}: ")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataFormatError, match="no rows") as error:
        load_prompts(str(tmp_path / "empty.jsonl"))
    assert str(error.value) == f"{tmp_path / 'empty.jsonl'}: no rows"
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not a parquet file")  # a truncated download
    with pytest.raises(DataFormatError) as error:
        load_prompts(str(tmp_path / "broken.parquet"))
    assert str(error.value).startswith(f"{tmp_path / 'broken.parquet'}: cannot read as Parquet: ")
