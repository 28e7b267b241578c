import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hacpo_megatron.data import DataFormatError, load_benchmark
from hacpo_megatron.rewards.math_verify import compute_score

# One small file per benchmark, in its usual field names, with the final answer each should yield.
BENCHMARK_ROWS = {
    "MATH-500": ({"problem": "Half?", "solution": "So \\boxed{\\frac12}.", "answer": "\\frac{1}{2}",
                  "unique_id": "t/1.json"}, "\\frac{1}{2}"),
    "math": ({"problem": "Half?", "solution": "First \\boxed{2}, no: \\boxed{\\frac{1}{2}}."}, "\\frac{1}{2}"),
    "gsm8k": ({"question": "How many?", "answer": "3 * 4 = <<3*4=12>>12 apples.\n#### 1,200"}, "1200"),
    "aime2025": ({"problem": "Find N.", "answer": "204", "id": 3}, "204"),
    "aime_2025": ({"question": "Find N.", "answer": 204}, "204"),
    "amc23": ({"question": "Area?", "answer": 27.0}, "27.0"),
    "minerva": ({"problem": "Speed?", "solution": "4.5e6"}, "4.5e6"),
    "Minerva": ({"question": "Speed?", "solution": "We get \\boxed{4.5}"}, "4.5"),
    "olympiadbench": ({"question": "Find x.", "final_answer": ["$\\frac{3}{2}$"]}, "\\frac{3}{2}"),
}


@pytest.mark.parametrize("name", sorted(BENCHMARK_ROWS))
def test_each_benchmark_file(tmp_path, name):
    row, truth = BENCHMARK_ROWS[name]
    path = tmp_path / "bench.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    records = load_benchmark(name, path)
    assert len(records) == 2
    assert records[0].ground_truth == truth
    assert records[0].messages[0]["role"] == "user" and records[0].question in ("Half?", "How many?", "Find N.",
                                                                             "Area?", "Speed?", "Find x.")
    # the extracted truth is in a form the reward accepts
    assert compute_score(records[0].data_source, f"\\boxed{{{truth}}}", records[0].ground_truth) == 1.0


def test_ids_and_parquet(tmp_path):
    path = tmp_path / "math500.parquet"
    pq.write_table(pa.Table.from_pylist([BENCHMARK_ROWS["MATH-500"][0]] * 2), path)
    records = load_benchmark("math500", path)
    assert [r.uid for r in records] == ["t/1.json", "t/1.json"] and records[0].data_source == "math500"
    aime = tmp_path / "aime.jsonl"
    aime.write_text(json.dumps({"problem": "p", "answer": "1"}) + "\n")
    assert load_benchmark("aime2025", aime)[0].uid == "aime2025-0"


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark 'svamp'"):
        load_benchmark("svamp", tmp_path / "x.jsonl")
    path = tmp_path / "gsm.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "#### 3"}) + "\n"
                    + json.dumps({"problem": "q", "answer": "3"}) + "\n")
    with pytest.raises(DataFormatError,
                       match=r"gsm.jsonl:line 2: gsm8k: missing field: expected one of \['question'\]"):
        load_benchmark("gsm8k", path)
    path = tmp_path / "olymp.jsonl"
    path.write_text(json.dumps({"question": "q", "final_answer": []}) + "\n")
    with pytest.raises(DataFormatError, match="line 1: olympiadbench: field 'final_answer' is an empty list"):
        load_benchmark("olympiadbench", path)
