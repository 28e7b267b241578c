"""Checkpoint manifests: every file's size and SHA-256, verified before a resume (pure file system)."""
import json

import pytest

from hacpo_megatron.checkpoint.integrity import (
    MANIFEST_FILE, DamagedCheckpoint, choose_resume_checkpoint, describe, verify_manifest, write_manifest,
)
from hacpo_megatron.checkpoint.run_folder import resume_candidates


def step_folder(root, step, payload=b"x" * 10_000):
    folder = root / f"step_{step:08d}"
    (folder / "agent" / "dist_checkpoint").mkdir(parents=True)
    (folder / "agent" / "dist_checkpoint" / "__0_0.distcp").write_bytes(payload + bytes([step]))
    (folder / "agent" / "metadata.json").write_text(json.dumps({"step": step}))
    (folder / "trainer_state.pt").write_bytes(b"state")
    write_manifest(folder)
    return folder


def flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_an_intact_folder_verifies_and_lists_every_file(tmp_path):
    folder = step_folder(tmp_path, 1)
    assert verify_manifest(folder) == 3
    assert set(json.loads((folder / MANIFEST_FILE).read_text())["files"]) == {
        "agent/dist_checkpoint/__0_0.distcp", "agent/metadata.json", "trainer_state.pt"}


@pytest.mark.parametrize("damage,reason", [
    (lambda f: flip_byte(f / "agent/dist_checkpoint/__0_0.distcp", 5_000), "content differs"),
    (lambda f: (f / "agent/dist_checkpoint/__0_0.distcp").write_bytes(b"short"), "bytes, the manifest says"),
    (lambda f: (f / "agent/metadata.json").unlink(), "missing"),
])
def test_a_damaged_file_is_named(tmp_path, damage, reason):
    folder = step_folder(tmp_path, 1)
    damage(folder)
    with pytest.raises(DamagedCheckpoint, match=reason) as error:
        verify_manifest(folder)
    assert error.value.path.name in ("__0_0.distcp", "metadata.json")


def test_no_manifest_means_not_verifiable(tmp_path):
    folder = step_folder(tmp_path, 1)
    (folder / MANIFEST_FILE).unlink()
    with pytest.raises(DamagedCheckpoint, match="cannot be verified"):
        verify_manifest(folder)
    (folder / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(DamagedCheckpoint, match="unreadable manifest"):
        verify_manifest(folder)


def test_resume_falls_back_to_the_newest_intact_step(tmp_path):
    for step in (5, 10, 15):
        step_folder(tmp_path, step)
    (tmp_path / "latest").write_text("step_00000015\n")
    flip_byte(tmp_path / "step_00000015" / "agent" / "dist_checkpoint" / "__0_0.distcp", 100)
    choice = choose_resume_checkpoint(resume_candidates(tmp_path))
    assert choice.step_dir.name == "step_00000010"
    warnings, error = describe(choice, tmp_path)
    assert error is None
    assert "step_00000015/agent/dist_checkpoint/__0_0.distcp is damaged" in warnings[0]
    assert "resuming from step_00000010" in warnings[-1]


def test_nothing_intact_is_an_error_and_a_bad_latest_pointer_is_survived(tmp_path):
    step_folder(tmp_path, 5)
    (tmp_path / "latest").write_text("step_00000099\n")  # names a folder that is not there
    assert [p.name for p in resume_candidates(tmp_path)] == ["step_00000005"]
    flip_byte(tmp_path / "step_00000005" / "trainer_state.pt", 0)
    warnings, error = describe(choose_resume_checkpoint(resume_candidates(tmp_path)), tmp_path)
    assert "no intact checkpoint" in error and "trainer_state.pt is damaged" in warnings[0]
    assert describe(choose_resume_checkpoint([]), tmp_path)[1].endswith(
        "no checkpoint saved yet; start without --resume")
