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
