import shutil
import tempfile

import pytest
import ray


@pytest.fixture
def ray_tmp(monkeypatch):
    """Ray's temp dir (RAY_TMPDIR) in a fresh folder, so the records a test's Ray writes or reads
    (`<tmp>/ray/ray_current_cluster`) are its own, never those of other users of the machine."""
    # Short: Ray's unix sockets live below it (the kernel allows 107 bytes per socket path).
    base = tempfile.mkdtemp(prefix="hr-", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", base)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield base
    if ray.is_initialized():
        ray.shutdown()
    shutil.rmtree(base, ignore_errors=True)
