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


# ------------------------------------------------------------------------------ side by side: pytest-xdist
# `make test` runs the suite on 2 worker processes (`-n 2 --dist loadgroup`, docs/testing.md). What a worker is
# given at a time is a whole file, or a whole `xdist_group` of files that share a session or package fixture (one
# built per worker otherwise): under `--dist loadgroup` a test without a group is its own unit in xdist itself,
# which would build a file's module fixtures (conversions, runs) once on each worker.
# Files with a slow test go first, then those with another heavy marker, then the rest, each in collection order:
# the long end-to-end units start at once and the short files fill in behind them.
HEAVY_MARKERS = (("slow",), ("distributed", "vllm", "real_weights"))


def _unit(item) -> str:
    """The unit a worker is given: the test's `xdist_group` (its first), else its file."""
    group = item.get_closest_marker("xdist_group")
    if group is not None:
        return str(group.args[0] if group.args else group.kwargs.get("name", "default"))
    return item.nodeid.split("::", 1)[0]


def _weight(items) -> int:
    names = {mark.name for item in items for mark in item.iter_markers()}
    return next((rank for rank, markers in enumerate(HEAVY_MARKERS) if names & set(markers)), len(HEAVY_MARKERS))


def _name_the_group(item) -> None:
    """What xdist's worker does for `--dist loadgroup`: a test of an `xdist_group` gets `@GROUP` after its id, the
    only thing the controller's scheduler sees. xdist 3.8.0 writes it into `item._nodeid`, which pytest 9.2 no longer
    reads (a node's id is `item._id`), so the groups would reach the scheduler as plain files: the shared fixtures
    built on both workers (tests/test_xdist_groups.py runs a suite to check)."""
    group = item.get_closest_marker("xdist_group")
    if group is None or "@" in item.nodeid.rsplit("::", 1)[-1] or not item.config.getvalue("loadgroup"):
        return
    suffixed = f"{item.nodeid}@{_unit(item)}"
    try:
        from _pytest.nodeid import coerce_node_id  # pytest >= 9.2
    except ImportError:  # before 9.2, xdist's own renaming works
        return
    item._id = coerce_node_id(suffixed)


@pytest.hookimpl(trylast=True)  # after -m has deselected what will not run
def pytest_collection_modifyitems(config, items):
    """On an xdist worker only (the controller hands out units in the order the workers collected them): each
    unit's tests moved together, heavy units first, collection order kept otherwise. Every worker collects the
    same tests, so every worker orders them alike (xdist checks that)."""
    if not hasattr(config, "workerinput"):
        return
    units: dict = {}
    for item in items:
        units.setdefault(_unit(item), []).append(item)
        _name_the_group(item)
    order = sorted(units.values(), key=_weight)  # stable: collection order within each weight
    items[:] = [item for unit in order for item in unit]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`, with a test of no group scheduled with the rest of its file (see above), in the
    order the workers collected the units (no re-sorting by test count)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class FilesAndGroups(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.rfind("@") > nodeid.rfind("]"):  # xdist appended the test's group (@name)
                return nodeid.split("@")[-1]
            return nodeid.split("::", 1)[0]

    config.option.loadscopereorder = False
    return FilesAndGroups(config, log)


# ------------------------------------------------------------------------------ where the suite's time goes, by file
# Under xdist the controller receives every worker's reports here, so these figures cover the whole run.
_SECONDS_BY_FILE: dict = {}
_WORKER_BY_FILE: dict = {}
_SECONDS_BY_WORKER: dict = {}


def pytest_runtest_logreport(report):
    """Setup, call and teardown of every test, summed per file (a module fixture's run counts in its file)
    and, under xdist, per worker."""
    path = report.nodeid.split("::")[0]
    _SECONDS_BY_FILE[path] = _SECONDS_BY_FILE.get(path, 0.0) + report.duration
    worker = getattr(report, "worker_id", None)
    if worker is not None:
        _WORKER_BY_FILE[path] = worker
        _SECONDS_BY_WORKER[worker] = _SECONDS_BY_WORKER.get(worker, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """After pytest's slowest tests, the slowest files: what CI's time budget is spent on (docs/testing.md);
    under xdist, the worker each file ran on and each worker's sum (their time side by side)."""
    if len(_SECONDS_BY_FILE) < 2:
        return
    ranked = sorted(_SECONDS_BY_FILE.items(), key=lambda item: -item[1])
    total = sum(_SECONDS_BY_FILE.values())
    terminalreporter.section("slowest 20 files (setup + call + teardown)")
    for path, seconds in ranked[:20]:
        worker = f"  {_WORKER_BY_FILE[path]}" if path in _WORKER_BY_FILE else ""
        terminalreporter.write_line(f"{seconds:8.1f}s {100 * seconds / total:5.1f} %{worker}  {path}")
    terminalreporter.write_line(f"{total:8.1f}s in all, {len(ranked)} files")
    if _SECONDS_BY_WORKER:
        terminalreporter.write_line("by worker: " + ", ".join(
            f"{worker} {seconds:.1f}s" for worker, seconds in sorted(_SECONDS_BY_WORKER.items())))
