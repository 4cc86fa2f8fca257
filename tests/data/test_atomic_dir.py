"""infra.tracking.atomic_dir: an artifact folder appears whole or not at all."""
import pytest

from infra.tracking import atomic_dir


def test_a_finished_block_replaces_the_old_folder(tmp_path):
    final = tmp_path / "out"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with atomic_dir(final) as tmp:
        (tmp / "new.txt").write_text("new")
        assert not (final / "new.txt").exists()  # nothing visible before the block ends
    assert sorted(p.name for p in final.iterdir()) == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp or .old folder left


def test_a_failed_block_keeps_the_old_folder_and_leaves_no_temp(tmp_path):
    final = tmp_path / "out"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as tmp:
            (tmp / "half.txt").write_text("half")
            raise RuntimeError("interrupted")
    assert (final / "old.txt").read_text() == "old" and not (final / "half.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
