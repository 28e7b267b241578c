"""Fixtures and helpers every test folder shares."""
import os
import shutil

import pytest


@pytest.fixture(scope="module")
def module_tmp(request, tmp_path_factory):
    """`mktemp` for a test module's shared files (models, checkpoints, runs), deleted once the module's tests
    are done, unless one of them failed (kept to be looked at, like pytest's own tmp_path under the
    "failed" retention policy in pyproject.toml). Kept to the session's end, the suite's folders reach
    ~13 GB in one run: a CI machine's disk filled up at that once."""
    made = []
    failed_before = request.session.testsfailed

    def mktemp(name):
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]

    yield mktemp
    if request.session.testsfailed == failed_before:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


def require_root(what: str) -> None:
    """Skip the calling test or fixture, saying why, unless this process runs as root: a few tests make network
    namespaces or mount a tmpfs, which only root may. CI runs as root, so it runs them; a user without root gets
    the rest of the suite and these named as skipped (pytest's -ra summary), not failed."""
    if os.geteuid() != 0:
        pytest.skip(f"needs root ({what}); run as root, as CI does, to include it")


# ------------------------------------------------------------------------------ where the suite's time goes, by file
_SECONDS_BY_FILE: dict = {}


def pytest_runtest_logreport(report):
    """Setup, call and teardown of every test, summed per file (a module fixture's run counts in its file)."""
    path = report.nodeid.split("::")[0]
    _SECONDS_BY_FILE[path] = _SECONDS_BY_FILE.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """After pytest's slowest tests, the slowest files: what CI's time budget is spent on (docs/testing.md)."""
    if len(_SECONDS_BY_FILE) < 2:
        return
    ranked = sorted(_SECONDS_BY_FILE.items(), key=lambda item: -item[1])
    total = sum(_SECONDS_BY_FILE.values())
    terminalreporter.section("slowest 20 files (setup + call + teardown)")
    for path, seconds in ranked[:20]:
        terminalreporter.write_line(f"{seconds:8.1f}s {100 * seconds / total:5.1f} %  {path}")
    terminalreporter.write_line(f"{total:8.1f}s in all, {len(ranked)} files")
