"""Checkpoint manifests: every file's size and SHA-256, verified before a resume (pure file system)."""
import json

import pytest

from hacpo_megatron.checkpoint.integrity import (
    MANIFEST_FILE, DamagedCheckpoint, choose_resume_checkpoint, describe, verify_manifest, write_manifest,
)
from hacpo_megatron.checkpoint.format import CheckpointError
from hacpo_megatron.checkpoint.run_folder import (
    LATEST_FILE, TMP_SUFFIX, latest_checkpoint, prune_checkpoints, publish_step, remove_interrupted_saves,
    resume_candidates,
)


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


@pytest.mark.parametrize("damage,reason,damaged", [
    (lambda f: flip_byte(f / "agent/dist_checkpoint/__0_0.distcp", 5_000), "content differs",
     "agent/dist_checkpoint/__0_0.distcp"),
    (lambda f: (f / "agent/dist_checkpoint/__0_0.distcp").write_bytes(b"short"),
     "5 bytes, the manifest says 10001", "agent/dist_checkpoint/__0_0.distcp"),  # 10_000 + the step's byte
    (lambda f: (f / "agent/metadata.json").unlink(), "missing", "agent/metadata.json"),
    (lambda f: flip_byte(f / "trainer_state.pt", 0), "content differs", "trainer_state.pt"),
])
def test_a_damaged_file_is_named(tmp_path, damage, reason, damaged):
    folder = step_folder(tmp_path, 1)
    damage(folder)
    with pytest.raises(DamagedCheckpoint, match=reason) as error:
        verify_manifest(folder)
    # the one file at fault, by its whole path (the others are intact), in the message a user reads
    assert error.value.path == folder / damaged
    assert str(error.value).startswith(f"{folder / damaged}: ")


def test_no_manifest_means_not_verifiable(tmp_path):
    folder = step_folder(tmp_path, 1)
    manifest = (folder / MANIFEST_FILE).read_text()
    (folder / MANIFEST_FILE).unlink()
    with pytest.raises(DamagedCheckpoint, match="cannot be verified"):
        verify_manifest(folder)
    (folder / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(DamagedCheckpoint, match="unreadable manifest") as error:
        verify_manifest(folder)
    assert error.value.path == folder / MANIFEST_FILE
    # a manifest of another format (or another program's manifest.json) is not taken as this one
    (folder / MANIFEST_FILE).write_text(json.dumps({"format": "other/1", "files": {}}))
    with pytest.raises(DamagedCheckpoint, match="unknown format 'other/1'"):
        verify_manifest(folder)
    # a manifest of the right format listing nothing would pass any folder as intact
    (folder / MANIFEST_FILE).write_text(json.dumps({"format": json.loads(manifest)["format"], "files": {}}))
    with pytest.raises(DamagedCheckpoint, match="unreadable manifest .it lists no files"):
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


def test_a_step_is_latest_only_once_published_complete_and_verifiable(tmp_path):
    """publish_step: the manifest is written, the folder renamed from its .tmp name, and only then `latest`
    moved; a save interrupted before that leaves `latest` at the step before and is never a resume candidate."""
    step_folder(tmp_path, 1)
    (tmp_path / LATEST_FILE).write_text("step_00000001\n")
    temporary = tmp_path / ("step_00000002" + TMP_SUFFIX)
    (temporary / "agent").mkdir(parents=True)
    (temporary / "agent" / "metadata.json").write_text(json.dumps({"step": 2}))
    (temporary / "trainer_state.pt").write_bytes(b"state 2")
    # interrupted here: the half-written step is neither latest nor tried by a resume
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"
    assert resume_candidates(tmp_path) == [tmp_path / "step_00000001"]

    publish_step(temporary, tmp_path / "step_00000002", tmp_path)
    assert not temporary.exists() and (tmp_path / LATEST_FILE).read_text() == "step_00000002\n"
    assert verify_manifest(tmp_path / "step_00000002") == 2  # the manifest lists what was saved, and it verifies
    assert resume_candidates(tmp_path) == [tmp_path / "step_00000002", tmp_path / "step_00000001"]

    # the same step saved again (after a resume): the new content wins, still verifiable, nothing left over
    again = tmp_path / ("step_00000002" + TMP_SUFFIX)
    again.mkdir()
    (again / "trainer_state.pt").write_bytes(b"state 2, saved again")
    publish_step(again, tmp_path / "step_00000002", tmp_path)
    assert (tmp_path / "step_00000002" / "trainer_state.pt").read_bytes() == b"state 2, saved again"
    assert verify_manifest(tmp_path / "step_00000002") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST_FILE, "step_00000001", "step_00000002"]


def test_interrupted_saves_are_removed_and_pruning_keeps_latest(tmp_path):
    for step in (1, 2, 3):
        step_folder(tmp_path, step)
    (tmp_path / ("step_00000004" + TMP_SUFFIX)).mkdir()
    (tmp_path / ("step_00000004" + TMP_SUFFIX) / "half.distcp").write_bytes(b"half")
    (tmp_path / "notes.tmp").write_text("a file, not a save: kept")
    assert remove_interrupted_saves(tmp_path) == [tmp_path / ("step_00000004" + TMP_SUFFIX)]
    assert (tmp_path / "notes.tmp").is_file()

    (tmp_path / LATEST_FILE).write_text("step_00000001\n")  # e.g. the newer steps failed to verify, or a rollback
    assert prune_checkpoints(tmp_path, keep_last=1) == [tmp_path / "step_00000002"]  # 3 is the newest, 1 latest
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000001", "step_00000003"]
    with pytest.raises(ValueError, match="keep_last must be >= 1, got 0"):
        prune_checkpoints(tmp_path, keep_last=0)


def test_a_latest_pointer_naming_no_step_folder_names_the_pointer(tmp_path):
    step_folder(tmp_path, 1)
    (tmp_path / "step_00000001.tmp").mkdir()  # folders that exist, yet are no finished step
    (tmp_path / "step_00000001" / "agent" / "step_00000001").mkdir()
    for name in ("step_00000007", "step_00000001.tmp", "step_00000001/agent/step_00000001", "agent"):
        (tmp_path / LATEST_FILE).write_text(name + "\n")
        with pytest.raises(CheckpointError) as error:
            latest_checkpoint(tmp_path)
        assert str(error.value).startswith(f"{tmp_path / LATEST_FILE}: names {name!r}")
