"""course_utils.tooling.build: from a solution notebook to the learner copy."""

import os

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from course_utils.tooling.build import BuildError, coalesce_streams, execute, learner_copy, solution_blocks, stub, tag_source
from course_utils.tooling.layout import learner_path

SOLUTION_CELL = '''import torch


def add_one(x):
    """Add one to every element."""
    ### BEGIN SOLUTION
    y = x + 1
    return y
    ### END SOLUTION
'''

CHECK_CELL = "lesson01.check_add_one(add_one)"


def test_stub_replaces_block_at_indent():
    out = stub(SOLUTION_CELL)
    assert out.splitlines() == [
        "import torch",
        "",
        "",
        "def add_one(x):",
        '    """Add one to every element."""',
        "    # YOUR CODE HERE",
        "    raise NotImplementedError()",
    ]
    compile(out, "<stub>", "exec")


def test_stub_keeps_deeper_indent_and_code_after_block():
    source = "class Net:\n    def forward(self, x):\n        ### BEGIN SOLUTION\n        return x\n        ### END SOLUTION\n\n\nnet = Net()"
    out = stub(source)
    assert "        raise NotImplementedError()" in out.splitlines()
    assert "return x" not in out
    assert out.endswith("net = Net()")
    compile(out, "<stub>", "exec")


def test_stub_handles_two_blocks():
    source = "def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION\n\ndef g():\n\t### BEGIN SOLUTION\n\treturn 2\n\t### END SOLUTION"
    out = stub(source)
    assert out.count("raise NotImplementedError()") == 2
    assert "\traise NotImplementedError()" in out
    assert "return" not in out


def test_stub_without_blocks_is_unchanged():
    assert stub("x = 1\nprint(x)") == "x = 1\nprint(x)"


def test_stub_rejects_top_level_block():
    with pytest.raises(BuildError, match=r"cell 3: a solution must sit inside a function body"):
        stub("### BEGIN SOLUTION\nx = 1\n### END SOLUTION", where="cell 3")


def test_stub_rejects_unclosed_block():
    with pytest.raises(BuildError, match=r"BEGIN SOLUTION is never closed"):
        stub("def f():\n    ### BEGIN SOLUTION\n    return 1")


def test_stub_rejects_end_without_begin():
    with pytest.raises(BuildError, match=r"### END SOLUTION without ### BEGIN SOLUTION"):
        stub("def f():\n    return 1\n    ### END SOLUTION")


def test_stub_rejects_nested_blocks():
    with pytest.raises(BuildError, match="nested"):
        stub("def f():\n    ### BEGIN SOLUTION\n    ### BEGIN SOLUTION\n    ### END SOLUTION")


def test_solution_blocks():
    assert solution_blocks(SOLUTION_CELL) == ["    y = x + 1\n    return y"]
    assert solution_blocks("x = 1") == []
    two = "def f():\n    ### BEGIN SOLUTION\n    a\n    ### END SOLUTION\ndef g():\n    ### BEGIN SOLUTION\n    b\n    ### END SOLUTION"
    assert solution_blocks(two) == ["    a", "    b"]


SCOREBOARD = "lesson01.scoreboard()"


def _notebook(*cells):
    """A notebook of these cells, ending with the scoreboard cell when it has an exercise."""
    nb = new_notebook()
    nb.cells = list(cells)
    if any("### BEGIN SOLUTION" in c.source for c in cells):
        nb.cells.append(new_code_cell(SCOREBOARD))
    return nb


def test_tag_source_tags_exercise_and_check_cells():
    nb = _notebook(
        new_markdown_cell("# Lesson 1"),
        new_code_cell("from course_utils import lesson01", metadata={"tags": ["nbval-check-output"]}),
        new_code_cell(SOLUTION_CELL, metadata={"tags": ["gpu", "exercise:stale"]}),
        new_code_cell(CHECK_CELL),
    )
    assert tag_source(nb) == ["add_one"]
    assert nb.cells[1].metadata["tags"] == ["nbval-check-output"]
    assert nb.cells[2].metadata["tags"] == ["gpu", "exercise:add_one"]
    assert nb.cells[3].metadata["tags"] == ["check:add_one"]


def test_tag_source_removes_stale_tags():
    nb = _notebook(new_code_cell("x = 1", metadata={"tags": ["check:old"]}))
    assert tag_source(nb) == []
    assert "tags" not in nb.cells[0].metadata


def test_tag_source_exercise_without_check():
    nb = _notebook(new_code_cell(SOLUTION_CELL), new_code_cell("print('no check here')"))
    with pytest.raises(BuildError, match=r"every exercise needs exactly one check cell.*\['add_one'\].*\[\]"):
        tag_source(nb)


def test_tag_source_check_without_exercise():
    nb = _notebook(new_code_cell(CHECK_CELL))
    with pytest.raises(BuildError, match="every exercise needs exactly one check cell"):
        tag_source(nb)


def test_tag_source_two_checks_in_one_cell():
    nb = _notebook(new_code_cell("lesson01.check_a(a)\nlesson01.check_b(b)"))
    with pytest.raises(BuildError, match="one check per cell"):
        tag_source(nb)


def test_tag_source_solution_cell_needs_one_function():
    nb = _notebook(new_code_cell(SOLUTION_CELL + "\n\ndef helper():\n    pass\n"))
    with pytest.raises(BuildError, match=r"exactly one top-level function, found \['add_one', 'helper'\]"):
        tag_source(nb)


def test_tag_source_markers_in_markdown():
    nb = _notebook(new_markdown_cell("### BEGIN SOLUTION"))
    with pytest.raises(BuildError, match="code cells only"):
        tag_source(nb)


def _tagged_source():
    nb = _notebook(
        new_markdown_cell("# Lesson 1"),
        new_code_cell("print('hi')", metadata={"tags": ["nbval-check-output"], "scrolled": True}),
        new_code_cell(SOLUTION_CELL, metadata={"tags": ["nbval-ignore-output"]}),
        new_code_cell(CHECK_CELL),
        new_code_cell("%%gpu\nprint(1)", metadata={"tags": ["gpu", "nbval-skip"]}),
    )
    for i, cell in enumerate(nb.cells[1:], start=1):
        cell.execution_count = i
        cell.outputs = [new_output("stream", name="stdout", text="hi\n")]
    nb.metadata["widgets"] = {"state": {}}
    tag_source(nb)
    return nb


def test_learner_copy_stubs_and_clears_outputs():
    nb = _tagged_source()
    learner = learner_copy(nb)
    for cell in learner.cells[1:]:
        assert cell.outputs == []
        assert cell.execution_count is None
    assert "raise NotImplementedError()" in learner.cells[2].source
    assert not any(block in learner.cells[2].source for block in solution_blocks(nb.cells[2].source))
    assert "widgets" not in learner.metadata
    nbformat.validate(learner)


def test_learner_copy_tags():
    learner = learner_copy(_tagged_source())
    assert learner.cells[1].metadata == {}  # nbval tag and "scrolled" gone
    assert learner.cells[2].metadata == {"tags": ["exercise:add_one"]}
    assert learner.cells[3].metadata == {"tags": ["check:add_one"]}
    assert learner.cells[4].metadata == {"tags": ["gpu", "nbval-skip"]}  # a skipped cell stays skipped for learners
    assert learner.cells[0].source == "# Lesson 1"


def test_learner_copy_leaves_source_untouched():
    nb = _tagged_source()
    learner_copy(nb)
    assert "### BEGIN SOLUTION" in nb.cells[2].source
    assert nb.cells[1].outputs and nb.cells[1].execution_count == 1
    assert nb.cells[1].metadata["tags"] == ["nbval-check-output"]
    assert "widgets" in nb.metadata


def test_learner_path(tmp_path):
    source = tmp_path / "notebooks" / "solutions" / "01_tensors.ipynb"
    assert learner_path(source) == tmp_path / "notebooks" / "01_tensors.ipynb"


def test_build_writes_tagged_source_and_learner_copy(tmp_path):
    from course_utils.tooling.build import build

    solutions = tmp_path / "notebooks" / "solutions"
    solutions.mkdir(parents=True)
    source = solutions / "01_tensors.ipynb"
    nbformat.write(_notebook(new_code_cell(SOLUTION_CELL), new_code_cell(CHECK_CELL)), source)
    assert build([source]) == [tmp_path / "notebooks" / "01_tensors.ipynb"]
    saved = nbformat.read(source, as_version=4)
    assert saved.metadata["course"]["lesson"] == "01"
    assert saved.cells[0].metadata["tags"] == ["hosted-setup"]  # the Colab set-up cell comes first (tests/test_publish.py)
    assert saved.cells[1].metadata["tags"] == ["exercise:add_one"]
    assert "### BEGIN SOLUTION" in saved.cells[1].source
    learner = nbformat.read(tmp_path / "notebooks" / "01_tensors.ipynb", as_version=4)
    assert "y = x + 1" not in learner.cells[1].source
    assert learner.cells[2].metadata["tags"] == ["check:add_one"]
    assert learner.metadata["course"]["lesson"] == "01"  # the checker and the grader read it


def test_a_lesson_ends_with_its_scoreboard():
    nb = _notebook(new_code_cell(SOLUTION_CELL), new_code_cell(CHECK_CELL))
    nb.cells.append(new_markdown_cell("## Summary"))
    assert tag_source(nb) == ["add_one"]  # markdown after it is fine
    nb.cells.append(new_code_cell("print('a demo after the scoreboard')"))
    with pytest.raises(BuildError, match=r"the last code cell must show the scoreboard: lessonNN\.scoreboard\(\)"):
        tag_source(nb)
    nb.metadata["course"] = {"lesson": "01"}
    nb.cells[-1].source = "lesson02.scoreboard()"
    with pytest.raises(BuildError, match=r"lesson01\.scoreboard\(\)"):
        tag_source(nb)


SCRIPT_CELL = '''%%writefile {folder}/train_digits.py
"""A script the learner completes."""
import sys


def main():
    ### BEGIN SOLUTION
    print("trained", sys.argv[1:])
    ### END SOLUTION


if __name__ == "__main__":
    main()
'''


def test_a_writefile_cell_is_an_exercise_named_after_its_file():
    nb = _notebook(new_code_cell(SCRIPT_CELL), new_code_cell("lesson09.check_train_digits(train_digits)"))
    assert tag_source(nb) == ["train_digits"]
    assert nb.cells[0].metadata["tags"] == ["exercise:train_digits"]
    assert nb.cells[1].metadata["tags"] == ["check:train_digits"]


def test_a_writefile_exercise_may_append_and_quote_its_path():
    for first in ("%%writefile -a {folder}/train_digits.py", "%%writefile '/tmp/x/train_digits.py'"):
        nb = _notebook(new_code_cell(SCRIPT_CELL.replace("%%writefile {folder}/train_digits.py", first)),
                       new_code_cell("lesson09.check_train_digits(train_digits)"))
        assert tag_source(nb) == ["train_digits"]


def test_a_writefile_exercise_needs_a_python_name_and_one_path():
    for first, message in [("%%writefile {folder}/train-digits.py", "'train-digits' must be a Python name"),
                           ("%%writefile", "needs one file to write")]:
        nb = _notebook(new_code_cell(SCRIPT_CELL.replace("%%writefile {folder}/train_digits.py", first)))
        with pytest.raises(BuildError, match=message):
            tag_source(nb)


def test_a_writefile_exercise_without_its_check_cell_is_refused():
    nb = _notebook(new_code_cell(SCRIPT_CELL), new_code_cell("print('no check')"))
    with pytest.raises(BuildError, match=r"every exercise needs exactly one check cell.*\['train_digits'\]"):
        tag_source(nb)


def test_the_learner_copy_of_a_writefile_exercise_is_a_runnable_skeleton(tmp_path):
    """The magic line stays, the script's solution becomes the stub, and the script runs up to that stub."""
    import subprocess
    import sys

    nb = _notebook(new_code_cell(SCRIPT_CELL), new_code_cell("lesson09.check_train_digits(train_digits)"))
    tag_source(nb)
    learner = learner_copy(nb).cells[0]
    assert learner.source.splitlines()[0] == "%%writefile {folder}/train_digits.py"
    assert learner.metadata == {"tags": ["exercise:train_digits"]}
    script = learner.source.split("\n", 1)[1]
    assert 'print("trained"' not in script and "    raise NotImplementedError()" in script
    path = tmp_path / "train_digits.py"
    path.write_text(script)
    ran = subprocess.run([sys.executable, str(path)], capture_output=True, text=True)
    assert ran.returncode == 1 and ran.stderr.strip().splitlines()[-1] == "NotImplementedError"


def test_a_script_without_a_function_around_its_solution_is_refused():
    source = "%%writefile {folder}/flat.py\nimport sys\n### BEGIN SOLUTION\nprint(1)\n### END SOLUTION\n"
    nb = _notebook(new_code_cell(source), new_code_cell("lesson09.check_flat(flat)"))
    tag_source(nb)  # named after the file
    with pytest.raises(BuildError, match="must sit inside a function body"):
        learner_copy(nb)


def test_coalesce_streams_joins_consecutive_chunks_of_one_stream():
    cell = new_code_cell("print(1); print(2)")
    cell.outputs = [
        new_output("stream", name="stdout", text="a\n"),
        new_output("stream", name="stdout", text="b\n"),
        new_output("stream", name="stderr", text="warning\n"),
        new_output("stream", name="stdout", text="c\n"),
        new_output("execute_result", data={"text/plain": "3"}, execution_count=1),
        new_output("stream", name="stdout", text="d\n"),
    ]
    nb = new_notebook(cells=[cell, new_markdown_cell("text")])
    coalesce_streams(nb)
    assert [(o.output_type, o.get("name"), o.get("text")) for o in cell.outputs] == [
        ("stream", "stdout", "a\nb\n"),
        ("stream", "stderr", "warning\n"),
        ("stream", "stdout", "c\n"),
        ("execute_result", None, None),
        ("stream", "stdout", "d\n"),
    ]
    assert "outputs" not in nb.cells[1]


def test_execute_shows_a_fresh_clones_work_folder_never_the_builders(tmp_path, monkeypatch):
    """Lesson 00's progress table must not show the records in the builder's own work/ (issue 18)."""
    builders = tmp_path / "work"
    builders.mkdir()
    (builders / ".progress.json").write_text('{"01": {"linear": {"status": "failed", "reason": "stale", "time": 1}}}')
    monkeypatch.setenv("COURSE_WORK_DIR", str(builders))
    monkeypatch.delenv("COURSE_CHECKER", raising=False)
    cell = new_code_cell(
        "import os\nfrom course_utils.tooling.layout import work_dir\n"
        f"print(os.environ['COURSE_CHECKER'], str(work_dir()) != {str(builders)!r}, work_dir().exists())"
    )
    execute(new_notebook(cells=[cell]), tmp_path / "lesson.ipynb")
    assert cell.outputs[0]["text"] == "1 True False\n"  # run as under the checker, in an empty work folder of its own
    assert os.environ["COURSE_WORK_DIR"] == str(builders) and "COURSE_CHECKER" not in os.environ  # both restored
