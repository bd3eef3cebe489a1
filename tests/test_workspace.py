"""course_utils.tooling.workspace: the learner's own notebooks in work/, and the promise that none is ever lost."""

import errno
import hashlib
import os
import shutil
from pathlib import Path

import nbformat
import pytest

from course_utils.tooling import layout, progress, workspace
from course_utils.tooling.checks import Verdict
from course_utils.tooling.layout import CourseError


@pytest.fixture
def work(tmp_path, monkeypatch):
    folder = tmp_path / "work"
    monkeypatch.setenv("COURSE_WORK_DIR", str(folder))
    return folder


def fresh(lesson: str) -> bytes:
    return layout.learner_path(layout.source_for(lesson)).read_bytes()


def learner_edit(path: Path, text: str = "# mine") -> bytes:
    """Simulate a learner: change a cell and save, the way JupyterLab would."""
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(text))
    nbformat.write(nb, path)
    return path.read_bytes()


def every_byte(folder: Path) -> set[str]:
    return {hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*.ipynb")}


def test_workspace_makes_every_lesson_once(work):
    made = workspace.ensure_workspace()
    assert [p.name for p in made] == [s.name for s in layout.source_notebooks()]
    for source in layout.source_notebooks():
        assert (work / source.name).read_bytes() == layout.learner_path(source).read_bytes()
    mine = learner_edit(work / made[1].name)
    (work / made[2].name).unlink()
    again = workspace.ensure_workspace()
    assert [p.name for p in again] == [made[2].name]  # only the missing one is made
    assert (work / made[1].name).read_bytes() == mine  # the learner's file is never overwritten


def test_reset_keeps_a_backup_and_writes_a_fresh_copy(work):
    workspace.ensure_workspace()
    source = layout.source_for("01")
    mine = learner_edit(work / source.name)
    progress.save_verdicts(work, "01", [Verdict("x", "passed")])
    target, saved = workspace.reset("1")
    assert target == work / source.name and target.read_bytes() == fresh("01")
    assert saved.parent == work / "backups" and saved.name.startswith(f"{source.stem}.") and saved.suffix == ".ipynb"
    assert saved.read_bytes() == mine
    assert "01" not in progress.load_records(work)  # the verdicts were for the old notebook


def test_reset_of_a_fresh_copy_makes_no_backup(work):
    workspace.ensure_workspace()
    assert workspace.reset("02")[1] is None
    assert not (work / "backups").exists()


def test_reset_makes_a_missing_copy(work):
    target, saved = workspace.reset("03")
    assert saved is None and target.read_bytes() == fresh("03")


def test_two_resets_in_one_second_keep_both_backups(work):
    workspace.ensure_workspace()
    path = work / layout.source_for("01").name
    first = learner_edit(path, "# one")
    workspace.reset("01")
    second = learner_edit(path, "# two")
    workspace.reset("01")
    assert {p.read_bytes() for p in workspace.backups_of("01")} == {first, second}


def test_reset_is_atomic(work, monkeypatch):
    """A write that fails half-way (disk full) leaves the learner's file whole, and the backup made."""
    workspace.ensure_workspace()
    path = work / layout.source_for("01").name
    mine = learner_edit(path)

    real_replace = os.replace

    def disk_full(src, dst):  # the backup is made; the notebook's own write fails
        if Path(dst).parent.name == "backups":
            return real_replace(src, dst)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(layout.os, "replace", disk_full)
    with pytest.raises(OSError):
        workspace.reset("01")
    assert path.read_bytes() == mine
    assert [b.read_bytes() for b in workspace.backups_of("01")] == [mine]
    assert not [p for p in work.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_backup_refuses_to_leave_a_partial_copy(work, monkeypatch):
    workspace.ensure_workspace()
    path = work / layout.source_for("01").name
    mine = learner_edit(path)
    monkeypatch.setattr(shutil, "copy2", lambda src, dst: Path(dst).write_bytes(Path(src).read_bytes()[:10]))
    with pytest.raises(CourseError, match="incomplete"):
        workspace.reset("01")
    assert path.read_bytes() == mine
    assert workspace.backups_of("01") == [] and not list((work / "backups").iterdir())


def _disk_full_after(n: int):
    """A copy that writes n bytes and then fails as a full disk does."""
    def copy(src, dst):
        Path(dst).write_bytes(Path(src).read_bytes()[:n])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return copy


@pytest.mark.parametrize("command", ["reset", "restore"])
def test_a_full_disk_during_the_backup_replaces_nothing_and_says_so(work, monkeypatch, command):
    workspace.ensure_workspace()
    path = work / layout.source_for("01").name
    learner_edit(path, "# kept")
    workspace.reset("01")
    mine = learner_edit(path, "# mine now")
    progress.save_verdicts(work, "01", [Verdict("x", "passed")])
    before = sorted(p.name for p in (work / "backups").iterdir())
    monkeypatch.setattr(shutil, "copy2", _disk_full_after(100))
    with pytest.raises(CourseError) as info:
        getattr(workspace, command)("01")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"could not back up {path}") and "the disk is full; nothing was replaced: free some disk space" in message
    assert path.read_bytes() == mine
    assert sorted(p.name for p in (work / "backups").iterdir()) == before  # no truncated backup, no temporary file
    assert progress.load_records(work)["01"]["x"]["status"] == "passed"


def test_a_full_disk_is_one_line_from_the_command_line(work, monkeypatch, capsys):
    from course_utils.tooling import cli

    workspace.ensure_workspace()
    path = work / layout.source_for("02").name
    mine = learner_edit(path)
    monkeypatch.setattr(shutil, "copy2", _disk_full_after(0))
    assert cli.main(["reset", "02"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: could not back up ") and "the disk is full" in err and err.count("\n") == 1
    assert path.read_bytes() == mine


def test_restore_refuses_a_truncated_backup_and_names_it(work):
    workspace.ensure_workspace()
    path = work / layout.source_for("03").name
    learner_edit(path, "# old")
    workspace.reset("03")
    mine = learner_edit(path, "# current")
    (broken,) = workspace.backups_of("03")
    broken.write_bytes(broken.read_bytes()[:200])  # as an older version's full disk left it
    with pytest.raises(CourseError) as info:
        workspace.restore("03")
    assert str(info.value).startswith(f"{broken} is not a readable notebook: its JSON breaks off at line ")
    assert "it was not restored: pick another with `python -m course_utils restore 03 --list`" in str(info.value)
    assert path.read_bytes() == mine
    assert workspace.backups_of("03") == [broken]  # and the current file was not backed up for nothing


@pytest.mark.parametrize("content", [b"", b"[]", b"\xff\xfe"])
def test_restore_by_name_refuses_a_backup_that_is_no_notebook(work, content):
    workspace.ensure_workspace()
    path = work / layout.source_for("03").name
    mine = path.read_bytes()
    (work / "backups").mkdir()
    bad = work / "backups" / f"{path.stem}.20260101-000000.ipynb"
    bad.write_bytes(content)
    with pytest.raises(CourseError, match=f"^{bad}"):
        workspace.restore("03", bad.name)
    assert path.read_bytes() == mine


def test_reset_backs_up_a_broken_notebook_as_it_is(work):
    """Reset is how a learner gets out of a broken notebook: its bytes are kept, though they are no notebook."""
    workspace.ensure_workspace()
    path = work / layout.source_for("04").name
    path.write_bytes(path.read_bytes()[:300])
    broken = path.read_bytes()
    target, saved = workspace.reset("04")
    assert saved.read_bytes() == broken and target.read_bytes() == fresh("04")


def test_restore_brings_back_the_newest_backup_and_keeps_the_current_file(work):
    workspace.ensure_workspace()
    path = work / layout.source_for("04").name
    old = learner_edit(path, "# old work")
    workspace.reset("04")
    newer = learner_edit(path, "# started again")
    target, used, saved = workspace.restore("04")
    assert target == path and path.read_bytes() == old
    assert used.read_bytes() == old and saved.read_bytes() == newer
    # restoring again is an undo: the file just replaced is now the newest backup
    workspace.restore("04")
    assert path.read_bytes() == newer


def test_restore_by_name(work):
    workspace.ensure_workspace()
    path = work / layout.source_for("05").name
    first = learner_edit(path, "# first")
    workspace.reset("05")
    learner_edit(path, "# second")
    workspace.reset("05")
    oldest = workspace.backups_of("05")[0]
    workspace.restore("05", oldest.stem)
    assert path.read_bytes() == first


def test_restore_errors_are_one_line(work):
    workspace.ensure_workspace()
    with pytest.raises(CourseError, match=r"^lesson 06 has no backups in .*backups$"):
        workspace.restore("06")
    learner_edit(work / layout.source_for("06").name)
    workspace.reset("06")
    with pytest.raises(CourseError, match=r"^no backup named 'nope'; the backups of this lesson are: 06_"):
        workspace.restore("06", "nope")


@pytest.mark.parametrize("steps", [["reset"], ["reset", "reset"], ["reset", "restore"], ["restore", "restore"], ["reset", "restore", "reset"]])
def test_no_learner_file_is_ever_lost(work, steps):
    """Whatever sequence of reset and restore: every version the learner saved is still somewhere in work/."""
    workspace.ensure_workspace()
    path = work / layout.source_for("01").name
    seen = set()
    for i, step in enumerate(steps):
        learner_edit(path, f"# version {i}")
        seen |= every_byte(work)
        if step == "restore" and not workspace.backups_of("01"):
            workspace.reset("01")
        getattr(workspace, step)("01")
        assert seen <= every_byte(work)


def test_the_chosen_edition_gives_the_copies_and_reset_keeps_to_it(work, monkeypatch):
    from course_utils.tooling import cli, language

    monkeypatch.delenv("COURSE_LANG", raising=False)
    assert cli.main(["workspace", "--lang", "zh"]) == 0
    chinese = layout.edition_learner_path(layout.source_for("01"), "zh")
    assert chinese.parent.name == "zh-CN" and (work / chinese.name).read_bytes() == chinese.read_bytes()
    assert language.remembered() == "zh"
    learner_edit(work / chinese.name)
    target, saved = workspace.reset("01")
    assert target.read_bytes() == chinese.read_bytes() and saved is not None
    monkeypatch.setenv("COURSE_LANG", "en")  # the environment wins: a fresh copy is English again
    workspace.reset("01")
    assert (work / chinese.name).read_bytes() == fresh("01")
