"""Tests that need root skip without it, saying so (tests/conftest.py: require_root), and every test file that
does what needs root (a mount, network namespaces) calls it: `make test` as a user without root runs the rest."""
import os
import re
from pathlib import Path

import pytest

from tests.conftest import require_root

TESTS = Path(__file__).resolve().parent
# what only root may do: mount a file system, make network or PID namespaces (tools/local_cluster.py)
NEEDS_ROOT = re.compile(r"\[\s*\"(?:mount|umount|unshare|nsenter)\"|\"netns\"|LocalCluster\.up\(|local_cluster\(")


def test_without_root_the_caller_skips_naming_why(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.skip.Exception, match=r"^needs root \(mounts a tmpfs\); run as root"):
        require_root("mounts a tmpfs")


def test_as_root_the_caller_runs(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert require_root("mounts a tmpfs") is None


def test_every_test_file_that_needs_root_asks_for_it():
    own = Path(__file__).resolve()
    needing = sorted(str(path.relative_to(TESTS)) for path in TESTS.rglob("*.py")
                     if path != own and NEEDS_ROOT.search(path.read_text()))
    assert "checkpoint/test_conversion.py" in needing and "e2e/test_multi_node.py" in needing  # the pattern works
    unasked = [name for name in needing if "require_root(" not in (TESTS / name).read_text()]
    assert unasked == [], f"need root but do not skip without it (tests/conftest.py: require_root): {unasked}"
