"""Routes to fool the checker: each gives no pass, and is failed with its reason or named for review; honest code never is.

The end-to-end test runs the real checker once over lesson 00's learner copy with one attack
added per notebook, and over an honest answer written differently from the solution, which must
pass with nothing to review. The solutions themselves are proven to pass with nothing to review by
`make test`: its strict nbval runs every lesson's solution, and under --nbval the course's plugin
fails a check that names a route for review (tests/test_plugin.py tests that rule).
tamper.scan is unit-tested on snippets, on every solution notebook and every learner copy.
"""

import importlib
import json
import sys
import types
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from course_utils.tooling import checkcell, layout, tamper
from course_utils.tooling.build import stub
from test_grade import without_demos

# ---------------------------------------------------------------- tamper.scan on snippets

SETUP = "%load_ext course_utils\nimport torch\nfrom course_utils import lesson00"


def scan_one(source: str, tags: tuple[str, ...] = ()) -> list[str]:
    """scan() of a lesson-00 notebook made of the setup cell and `source`."""
    nb = new_notebook(cells=[new_code_cell(SETUP), new_code_cell(source, metadata={"tags": list(tags)})])
    nb.metadata["course"] = {"lesson": "00"}
    return tamper.scan(json.loads(nbformat.writes(nb)))


FLAGGED = [
    ("from course_utils.lesson00 import add_one", tamper.REFERENCE),
    ("from course_utils.lesson00 import *", tamper.REFERENCE),
    ("import course_utils.lesson00 as L\nadd_one = L.add_one", tamper.REFERENCE),
    ("def add_one(x):\n    return lesson00.add_one(x)", tamper.REFERENCE),
    ("def add_one(x):\n    return getattr(lesson00, 'add_one')(x)", tamper.REFERENCE),
    ("add_one = lambda x: lesson00.add_one(x)", tamper.REFERENCE),
    ("import sys\ndef add_one(x):\n    return getattr(sys.modules['course_utils.lesson00'], 'add_one')(x)", tamper.REFERENCE),
    ("source = open('course_utils/lesson00.py').read()", tamper.REFERENCE),
    ("import sys\ndef add_one(x):\n    return sys._getframe(2).f_globals['add_one'](x)", tamper.FRAMES),
    ("import inspect\ndef draw(s, n):\n    return inspect.stack()[2].frame.f_globals['draw'](s, n)", tamper.FRAMES),
    ("from inspect import currentframe\nf = currentframe()", tamper.FRAMES),
    ("def f():\n    try:\n        raise ValueError\n    except ValueError as e:\n        return e.__traceback__.tb_frame.f_back", tamper.FRAMES),
    ("import gc\nrefs = gc.get_referrers(lesson00)", tamper.OBJECT_GRAPH),
    ("from course_utils.tooling import verdicts\nverdicts.checker_running = lambda: False", tamper.PATCH),
    ("from course_utils.tooling.verdicts import Verdict\nVerdict.passed = property(lambda self: True)", tamper.PATCH),
    ("import course_utils.tooling.checkcell as c\nc.run = lambda *a: None", tamper.PATCH),
    ("import sys, types\nsys.modules['course_utils.tooling.checkcell'] = types.SimpleNamespace(run=print)", tamper.PATCH),
    ("import sys\nsys.modules.pop('course_utils.tooling.checks')", tamper.PATCH),
    ("lesson00.check_add_one = lambda fn: print('PASS')", tamper.PATCH),
    ("import course_utils.tooling.checkcell", tamper.CHECKER),
    ("import importlib\nm = importlib.import_module('course_utils.tooling.checks')", tamper.CHECKER),
    ("__import__ = lambda *a, **k: None", tamper.BUILTINS),
    ("import builtins\nbuiltins.__import__ = lambda *a, **k: None", tamper.BUILTINS),
    ("__builtins__.__dict__['print'] = None", tamper.BUILTINS),
    ("def globals():\n    return {}", tamper.BUILTINS),
    ("get_ipython().input_transformers_post.append(lambda lines: ['pass\\n'])", tamper.IPYTHON),
    ("ip = get_ipython()\nip.input_transformers_cleanup.insert(0, str)", tamper.IPYTHON),
    ("get_ipython().set_custom_exc((Exception,), lambda *a, **k: None)", tamper.IPYTHON),
    ("get_ipython().ast_transformers.append(object())", tamper.IPYTHON),
    ("get_ipython().showtraceback = lambda *a, **k: None", tamper.IPYTHON),
    ("get_ipython().events.register('pre_run_cell', print)", tamper.IPYTHON),
    ("class T(torch.Tensor):\n    def allclose(self, *a, **k):\n        return True", tamper.SUBCLASS),
    ("from torch import Tensor\nclass T(Tensor):\n    pass", tamper.SUBCLASS),
    ("class M:\n    @classmethod\n    def __torch_function__(cls, f, t, a=(), k=None):\n        return True", tamper.SUBCLASS),
    ("from torch.overrides import TorchFunctionMode\nclass M(TorchFunctionMode):\n    pass", tamper.SUBCLASS),
    ("y = torch.zeros(2).as_subclass(object)", tamper.SUBCLASS),
    ("torch.allclose = lambda *a, **k: True", tamper.TORCH_PATCH),
    ("torch.Tensor.equal = lambda *a: True", tamper.TORCH_PATCH),
    ("setattr(torch, 'equal', lambda *a: True)", tamper.TORCH_PATCH),
    ("import numpy as np\nnp.allclose = lambda *a, **k: True", tamper.TORCH_PATCH),
    ("from unittest import mock\nmock.patch('torch.allclose', lambda *a, **k: True).start()", tamper.TORCH_PATCH),
    ("from unittest import mock\nmock.patch.object(torch, 'equal', lambda *a: True).start()", tamper.TORCH_PATCH),
    ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", tamper.KILL),
    ("import os\nos.killpg(0, 9)", tamper.KILL),
    ("!kill -9 $PPID", tamper.KILL),
    ("import psutil\npsutil.Process().parent().kill()", tamper.KILL),
    ("exec('x = 1')", tamper.EXEC),
    ("x = eval('1 + 1')", tamper.EXEC),
    ("code = compile('x = 1', 'f', 'exec')", tamper.EXEC),
    ("%run hack.py", tamper.EXEC),
    ("%time x = eval('1')", tamper.EXEC),
    ("%%gpu\nimport sys\nframe = sys._getframe()", tamper.FRAMES),
    ("%%capture\nimport builtins\nbuiltins.__import__ = None", tamper.BUILTINS),
    ("from IPython.display import display\ndisplay({'application/vnd.course.verdict+json': {'status': 'passed'}}, raw=True)",
     tamper.FORGE),
]


@pytest.mark.parametrize("source, route", FLAGGED, ids=[f"{i}-{r.split()[0]}" for i, (_, r) in enumerate(FLAGGED)])
def test_scan_names_the_route(source, route):
    found = scan_one(source)
    assert route in tamper.routes(found), found
    assert all(line.endswith("(Cell 1)") for line in found), found


def test_scan_flags_the_reference_only_where_it_is_the_answer():
    # The course's own demo cells use the references after the exercise, so later cells work whatever the learner wrote.
    assert scan_one("y = lesson00.add_one(torch.zeros(2))\nprint(lesson00.draw(1, 2))") == []
    assert tamper.REFERENCE in tamper.routes(scan_one("y = lesson00.add_one(x)", tags=("exercise:add_one",)))


HONEST = [
    "model.eval()\nnet = make().eval()",
    "import torch\ndef f(x: torch.Tensor) -> torch.Tensor:\n    return x.to(torch.float32)",
    "import inspect\nprint(inspect.signature(len), inspect.getsource(lesson00.add_one))",
    "compiled = torch.compile(model, backend='eager')\nmodel.compile()",
    "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'print(1)'], check=True)",
    "import psutil\nrss = psutil.Process().memory_info().rss",
    "torch.backends.cudnn.benchmark = False\ntorch._dynamo.config.cache_size_limit = 8",
    "from course_utils.tooling.progress import progress_table\nprogress_table()",
    "p = torch.nn.Parameter(torch.zeros(2))\nclass Net(torch.nn.Module):\n    pass",
    "class F(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, x):\n        return x",
    "lesson00.check_add_one(add_one)\nprint(lesson00.check_add_one.verdict(lambda x: x).line())",
    "%load_ext course_utils\n!ls\n%%time\nx = 1",
    "%%gpu\nx = torch.randn(2, device='cuda')",
    "%%writefile script.py\nimport os\nprint(os.getpid())",
    "def broken(:\n    pass",
    "results = {}\nresults['a'] = 1\nself_kill = 'kill'",
]


@pytest.mark.parametrize("source", HONEST)
def test_scan_leaves_honest_code_alone(source):
    assert scan_one(source) == []


@pytest.mark.parametrize("folder", ["solutions", "learner"])
def test_scan_of_every_course_notebook_is_empty(folder):
    sources = layout.source_notebooks()
    paths = sources if folder == "solutions" else [layout.learner_path(s) for s in sources]
    assert len(paths) == len(sources) >= 12  # lessons 00 to 11
    for path in paths:
        assert tamper.scan(json.loads(path.read_text())) == [], path.name


@pytest.mark.parametrize("tags, source, expected", [
    (["check:add_one", "raises-exception"], "lesson00.check_add_one(add_one)", ["raises-exception"]),
    (["exercise:add_one", "nbval-skip", "skip"], "def add_one(x): ...", ["nbval-skip", "skip"]),
    (["check:draw"], "# NBVAL_RAISES_EXCEPTION\nlesson00.check_draw(draw)", ["NBVAL_RAISES_EXCEPTION"]),
    (["check:draw"], "  #  NBVAL_SKIP  \nlesson00.check_draw(draw)", ["NBVAL_SKIP"]),
    (["check:draw", "nbval-ignore-output"], "# NBVAL_IGNORE_OUTPUT\nlesson00.check_draw(draw)", []),  # the course's own; changes no verdict
    (["raises-exception"], "1 / 0", []),  # a pitfall cell of the learner's own may raise
    ([], "# NBVAL_SKIP\nx = 1", []),
    (["check:draw"], "lesson00.check_draw(draw)  # NBVAL_SKIP later on the line is no marker", []),
])
def test_verdict_tags_only_on_exercise_and_check_cells(tags, source, expected):
    assert tamper.verdict_tags(tags, source) == expected


def test_scan_names_nbval_tags_on_check_cells():
    nb = json.loads(nbformat.writes(tagged(["raises-exception"])))
    found = tamper.scan(nb)
    assert found and all(line.startswith(f"{tamper.NBVAL_TAGS}: raises-exception (Cell ") for line in found)
    assert len(found) == 4  # lesson 00's two exercise cells and their two check cells
    assert tamper.routes(found) == {tamper.NBVAL_TAGS}


def test_scan_survives_odd_notebooks():
    assert tamper.scan({"cells": []}) == []
    assert tamper.scan({"cells": [{"cell_type": "code", "source": ["%%bash\n", "kill -9 1\n"]}, "junk", {"cell_type": "markdown"}]}) == []
    assert tamper.scan({"cells": [{"cell_type": "code", "source": "x = (", "metadata": {"tags": 3}}]}) == []


# ---------------------------------------------------------------- the kernel-side checks on honest code

def _test_module_functions():
    """Every function the lessons' unit tests define: their correct alternatives, wrong answers and helpers."""
    sys.path.insert(0, str(Path(__file__).parent))
    for lesson in ("00", "01", "02", "05"):
        module = importlib.import_module(f"test_lesson{lesson}")
        for name, value in vars(module).items():
            if isinstance(value, types.FunctionType) and value.__module__ == module.__name__:
                yield lesson, name, value


def test_kernel_checks_leave_the_tests_answers_alone():
    """No answer in the lessons' tests is taken for the reference or for frame inspection (unless it calls the reference, L.x)."""
    checked = 0
    for lesson, name, fn in _test_module_functions():
        assert checkcell.reference_origin(fn) is None, name
        uses_reference = any("L" in code.co_names for code, _ in checkcell.learner_code(fn))
        if not uses_reference:
            assert checkcell.code_fault(name, fn) is None, name
            checked += 1
    assert checked > 100


def test_kernel_checks_find_the_reference_and_frames():
    from course_utils import lesson00

    assert checkcell.reference_origin(lesson00.add_one) == "course_utils.lesson00.add_one"
    namespace = {"lesson00": lesson00}
    exec("def add_one(x):\n    return lesson00.add_one(x)", namespace)
    reason, route = checkcell.code_fault("add_one", namespace["add_one"])
    assert reason == "your add_one calls the course's reference course_utils.lesson00.add_one: write your own"
    exec("import sys\ndef helper(s, n):\n    return sys._getframe(3).f_globals['draw'](s, n)\ndef draw(s, n):\n    return helper(s, n)", namespace)
    reason, route = checkcell.code_fault("draw", namespace["draw"])
    assert reason == "your draw reads the checker's stack frames (_getframe, f_globals): write your own code"
    assert route.startswith(tamper.FRAMES)
    exec("import sys\ndef sneaky(s, n):\n    return getattr(sys, '_getframe')(2).f_locals['fn'](s, n)", namespace)
    assert checkcell.code_fault("draw", namespace["sneaky"])[1] == f"{tamper.FRAMES}: draw uses _getframe, f_locals"
    exec("import sys\ndef by_name(x):\n    return getattr(sys.modules['course_utils.lesson00'], 'add_one')(x)", namespace)
    assert checkcell.code_fault("add_one", namespace["by_name"])[1] == f"{tamper.REFERENCE}: add_one calls course_utils.lesson00.add_one"


def test_a_learners_tensor_subclass_that_overrides_comparisons_is_found():
    def sneaky():
        return [k for k in checkcell.learner_tensor_subclasses() if k.__qualname__ == "Sneaky"]

    assert sneaky() == []
    namespace = {"__name__": "__main__"}
    exec(SUBCLASS.replace("Always", "Sneaky"), {**namespace, "torch": __import__("torch")}, namespace)
    (kind,) = sneaky()
    assert checkcell.subclass_fault() is not None
    reason, route = checkcell.subclass_message(kind)
    assert reason == ("your code defines Sneaky, a torch.Tensor subclass that overrides __torch_function__: "
                      "the checks compare plain tensors; remove it")
    assert route == f"{tamper.SUBCLASS}: class Sneaky overrides __torch_function__"
    del namespace["Sneaky"]
    import gc

    gc.collect()  # __subclasses__ holds its classes weakly


def test_torch_is_trusted_until_patched(monkeypatch):
    import torch

    assert checkcell.untrusted_torch() is None
    namespace = {}
    exec("fake = lambda *a, **k: True", namespace)
    monkeypatch.setattr(torch, "allclose", namespace["fake"])
    reason, route = checkcell.untrusted_torch()
    assert reason == "your code replaced torch.allclose, which the check compares with: remove that patch"


# ---------------------------------------------------------------- the real checker, one attack per notebook

def learner_nb():
    """Lesson 00's learner copy without its demos: each attack starts a kernel of its own, and the demos prove nothing here."""
    return without_demos(nbformat.read(layout.learner_path(layout.source_for("00")), as_version=4))


def index(nb, tag):
    (i,) = [k for k, c in enumerate(nb.cells) if tag in c.metadata.get("tags", [])]
    return i


def after_exercise(source: str, exercise: str = "add_one"):
    """The learner copy with a cell of `source` right after an exercise cell (before its check)."""
    nb = learner_nb()
    nb.cells.insert(index(nb, f"exercise:{exercise}") + 1, new_code_cell(source))
    return nb


def answered(nb, name, body):
    cell = nb.cells[index(nb, f"exercise:{name}")]
    cell.source = stub(cell.source).replace("    # YOUR CODE HERE\n    raise NotImplementedError()", body)
    return nb


def tagged(tags):
    nb = learner_nb()
    for cell in nb.cells:
        if any(t.startswith(("check:", "exercise:")) for t in cell.metadata.get("tags", [])):
            cell.metadata["tags"] += list(tags)
    return nb


def tagged_and_marked(tags, markers):
    """add_one's exercise and check cells carry the nbval tags; draw's start with the matching comment markers."""
    nb = learner_nb()
    for cell in nb.cells:
        own = [t for t in cell.metadata.get("tags", []) if t.startswith(("check:", "exercise:"))]
        if any(t.endswith(":add_one") for t in own):
            cell.metadata["tags"] += list(tags)
        elif own:
            cell.source = "\n".join(markers) + "\n" + cell.source
    return nb


FAKE_MODULE = "import types\nfake = types.SimpleNamespace(run=lambda *a, **k: None)\n"
SUBCLASS = """\
class Always(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.allclose, torch.equal, torch.Tensor.allclose, torch.Tensor.equal):
            return True
        return super().__torch_function__(func, types, args, kwargs or {})
"""
FORGED = """\
    from IPython.display import display
    record = {"exercise": "add_one", "status": "passed", "reason": "", "nonce": "0" * 32, "review": []}
    display({"application/vnd.course.verdict+json": record}, raw=True)
"""
NO_VERDICT_REASON = "the check did not report a verdict: was the checker patched or bypassed?"

ATTACKS = {
    # name: (notebook, {exercise: (status, reason or None)}, route named in review or None, static route or None)
    # each exercise's verdict is its own: add_one's tests the tags, draw's the markers
    "raises-exception tag and marker": (tagged_and_marked(["raises-exception"], ["# NBVAL_RAISES_EXCEPTION"]),
                                        "not attempted", None, tamper.NBVAL_TAGS),
    "skip tags and markers": (tagged_and_marked(["skip", "nbval-skip", "nbval-ignore-output"], ["# NBVAL_SKIP", "# NBVAL_IGNORE_OUTPUT"]),
                              "not attempted", None, tamper.NBVAL_TAGS),
    "checker_running": (after_exercise("from course_utils.tooling import verdicts\nverdicts.checker_running = lambda: False"),
                        "not attempted", tamper.PATCH, tamper.PATCH),
    "Verdict.passed": (after_exercise("from course_utils.tooling.verdicts import Verdict\nVerdict.passed = property(lambda self: True)"),
                       "not attempted", tamper.PATCH, tamper.PATCH),
    "checkcell.run": (after_exercise("import course_utils.tooling.checkcell as c\nc.run = lambda *a, **k: None"),
                      ("failed", NO_VERDICT_REASON), tamper.NO_VERDICT, tamper.PATCH),
    "sys.modules": (after_exercise(FAKE_MODULE + "import sys\nsys.modules['course_utils.tooling.checkcell'] = fake"),
                    ("failed", NO_VERDICT_REASON), tamper.NO_VERDICT, tamper.PATCH),
    "__import__": (after_exercise(FAKE_MODULE + "__import__ = lambda *a, **k: fake"),
                   ("failed", NO_VERDICT_REASON), tamper.NO_VERDICT, tamper.BUILTINS),
    "input transformer": (after_exercise("get_ipython().input_transformers_post.append("
                                         "lambda lines: ['pass\\n'] if 'checkcell' in ''.join(lines) else lines)"),
                          ("failed", NO_VERDICT_REASON), tamper.NO_VERDICT, tamper.IPYTHON),
    "set_custom_exc": (after_exercise("get_ipython().set_custom_exc((BaseException,), lambda *a, **k: None)"),
                       "not attempted", tamper.IPYTHON, tamper.IPYTHON),
    "reference": (answered(learner_nb(), "add_one", "    from course_utils.lesson00 import add_one as reference\n    return reference(x)"),
                  None, tamper.REFERENCE, tamper.REFERENCE),
    "reference import": (after_exercise("from course_utils.lesson00 import add_one"),
                         ("failed", "your add_one is the course's reference, imported from course_utils.lesson00: write your own"),
                         tamper.REFERENCE, tamper.REFERENCE),
    "frames": (answered(learner_nb(), "draw", "    import sys\n    return sys._getframe(2).f_globals['draw'](seed, n)"),
               None, tamper.FRAMES, tamper.FRAMES),
    "tensor subclass": (after_exercise(SUBCLASS + "def add_one(x):\n    return (x * 0).as_subclass(Always)"),
                        None, tamper.SUBCLASS, tamper.SUBCLASS),
    "forged record": (answered(learner_nb(), "add_one", FORGED), ("failed", "add_one(tensor of shape (3,), dtype torch.float32) is None: "
                                                                  "did you forget to `return` it?"), tamper.FORGE, tamper.FORGE),
    "torch patched by the answer": (answered(learner_nb(), "add_one", "    torch.allclose = lambda *a, **k: True\n    return x.clone()"),
                                    ("failed", "your code replaced torch.allclose, which the check compares with: remove that patch"),
                                    tamper.TORCH_PATCH, tamper.TORCH_PATCH),
    "torch patch": (after_exercise("torch.allclose = lambda *a, **k: True\ntorch.equal = lambda *a, **k: True\n"
                                   "def add_one(x):\n    return x.clone()"),
                    ("failed", "your code replaced torch.allclose, which the check compares with: remove that patch"),
                    tamper.TORCH_PATCH, tamper.TORCH_PATCH),
}


def solved_differently():
    nb = learner_nb()
    answered(nb, "add_one", "    y = x.clone()\n    y += 1\n    return y")
    return answered(nb, "draw", "    with torch.random.fork_rng(devices=[]):\n        torch.manual_seed(seed)\n        return torch.randn(n)")


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """One run of the real checker over every attack and an honest notebook: {name: the notebook's report}."""
    from course_utils.tooling.runner import run_checker

    folder = tmp_path_factory.mktemp("attacks")
    notebooks = {name: nb for name, (nb, *_) in ATTACKS.items()}
    # The solutions are not run here: make test's strict nbval runs all of them, and fails a check with a route.
    notebooks["solved differently"] = solved_differently()
    paths = {}
    for number, (name, nb) in enumerate(notebooks.items()):
        path = folder / f"{number:02d}" / layout.source_for("00").name
        path.parent.mkdir()
        nbformat.write(nb, path)
        paths[name] = str(path.resolve())
    report = run_checker(list(paths.values()))
    return {name: report[path] for name, path in paths.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ATTACKS))
def test_an_attack_never_passes(checked, name):
    nb, expected, review_route, static_route = ATTACKS[name]
    result = checked[name]
    verdicts = result["exercises"]
    assert all(v["status"] != "passed" for v in verdicts.values()), verdicts
    if isinstance(expected, str):
        assert {v["status"] for v in verdicts.values()} == {expected}, verdicts
    elif isinstance(expected, tuple):
        assert (verdicts["add_one"]["status"], verdicts["add_one"]["reason"]) == expected, verdicts
    if review_route:
        assert any(line.startswith(review_route) for line in result["review"]), result["review"]
    else:
        assert result["review"] == []
    found = tamper.scan(json.loads(nbformat.writes(nb)))
    assert (static_route in tamper.routes(found)) if static_route else found == [], found


@pytest.mark.slow
def test_the_named_faults(checked):
    assert checked["frames"]["exercises"]["draw"] == {
        "status": "failed", "reason": "your draw reads the checker's stack frames (_getframe, f_globals): write your own code"}
    assert checked["reference"]["exercises"]["add_one"] == {
        "status": "failed", "reason": "your add_one calls the course's reference course_utils.lesson00.add_one: write your own"}
    subclass = checked["tensor subclass"]["exercises"]["add_one"]
    assert subclass["status"] == "failed" and "is a torch.Tensor subclass (__main__.Always): return a plain tensor" in subclass["reason"]


@pytest.mark.slow
def test_an_honest_answer_written_differently_passes_with_nothing_to_review(checked):
    """The solutions pass with nothing to review under make test's strict nbval (every lesson); this is another honest answer."""
    result = checked["solved differently"]
    assert {v["status"] for v in result["exercises"].values()} == {"passed"}, result["exercises"]
    assert result["review"] == []
    assert result["stopped_at"] is None
