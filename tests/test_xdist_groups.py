"""What `make test` may run side by side (two pytest-xdist workers, docs/testing.md): every test file that uses a
fixture other files share, or keeps files in /dev/shm, carries the `xdist_group` that keeps those files on one worker.
Without it the suite still passes, but builds a second reference run or SmolLM2 conversion (minutes) on the other
worker; or vLLM's files would count as tests/e2e/test_vllm_run.py's leftovers."""
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# fixtures of a session or package, shared by files (tests/e2e/conftest.py, tests/checkpoint/conftest.py): its group
SHARED_FIXTURES = {"reference_run": "reference_run", "smollm2_hf": "smollm2_hf"}
# starts vLLM, or makes or checks files in /dev/shm
DEV_SHM = re.compile(r"pytest\.mark\.vllm|/dev/shm")


def _test_files() -> dict:
    own = Path(__file__).resolve()
    return {str(p.relative_to(TESTS)): p.read_text() for p in sorted(TESTS.rglob("test_*.py")) if p != own}


def group_of(text: str):
    found = re.findall(r"xdist_group\(\"(\w+)\"\)", text)
    return found[0] if len(found) == 1 else found or None


def test_files_sharing_a_session_or_package_fixture_are_in_its_group():
    users = {}
    for name, text in _test_files().items():
        for fixture, group in SHARED_FIXTURES.items():
            if re.search(rf"def \w+\([^)]*\b{fixture}\b", text):
                users.setdefault(fixture, []).append(name)
                assert group_of(text) == group, f"{name} uses {fixture}: it needs xdist_group(\"{group}\")"
    # the patterns find the files they are about
    assert {"e2e/test_hacpo_run.py", "e2e/test_reliability.py"} <= set(users["reference_run"])
    assert {"checkpoint/test_gguf.py", "checkpoint/test_smollm2_conversion.py"} <= set(users["smollm2_hf"])


def test_files_that_keep_files_in_dev_shm_share_one_worker():
    files = _test_files()
    named = sorted(name for name, text in files.items() if DEV_SHM.search(text))
    assert {"e2e/test_vllm_run.py", "rollout/test_vllm.py", "orchestrator/test_shared_memory.py"} <= set(named)
    assert {name: group_of(files[name]) for name in named} == {name: "dev_shm" for name in named}


def test_a_group_of_files_runs_on_one_worker_under_make_tests_options(tmp_path):
    """A suite of its own under this conftest and `-n 2 --dist loadgroup`: the two files of one group on one worker
    (each test writes its worker's name), a third file wherever."""
    import os
    import subprocess
    import sys

    import pytest

    pytest.importorskip("xdist", reason="pytest-xdist (setup.py's dev extra) is not installed")
    for name, group in (("a", 'pytestmark = pytest.mark.xdist_group("shared")\n'),
                        ("b", 'pytestmark = pytest.mark.xdist_group("shared")\n'), ("c", "")):
        (tmp_path / f"test_{name}.py").write_text(
            "import os\nimport pytest\n" + group + "\n\n@pytest.mark.parametrize('i', [1, 2, 3])\n"
            f"def test_writes_its_worker(i):\n    with open('{name}.seen', 'a') as f:\n"
            "        f.write(os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n")
    env = dict(os.environ, PYTHONPATH=str(TESTS.parent))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                           "-n", "2", "--dist", "loadgroup", "."], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = {name: (tmp_path / f"{name}.seen").read_text().split() for name in "abc"}
    assert all(len(workers) == 3 for workers in seen.values())
    assert len(set(seen["a"] + seen["b"])) == 1, seen  # the group, on one worker
