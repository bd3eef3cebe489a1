"""Signs that a notebook tries to fool the checker, found without running it: a static scan of its code cells.

A submission's code runs in the same kernel as the checks, so it can always reach them; the
checker closes the cheap routes (see checkcell and the plugin), and this scan names the rest
for an instructor to review. The grader runs `scan` outside the sandbox, on the file itself:
it parses the cells (IPython's magics and shell escapes transformed first) and executes nothing.

Each finding is one line: the route, what was seen, and where, e.g.
"frame inspection: sys._getframe (Cell 4)". The route labels are shared with the checks made at
run time inside the kernel (checkcell), so that both name a route the same way.
"""

import ast
import re

REFERENCE = "uses the course's reference"
CHECKER = "imports the checker"
FRAMES = "frame inspection"
OBJECT_GRAPH = "garbage-collector inspection"
PATCH = "patches the checker or its modules"
BUILTINS = "replaces __import__ / builtins"
IPYTHON = "IPython hooks (input transformer / set_custom_exc / ast transformer)"
SUBCLASS = "torch.Tensor subclass / __torch_function__"
TORCH_PATCH = "patches torch comparison functions"
KILL = "kills or signals other processes"
EXEC = "dynamic code execution"
FORGE = "forges a verdict record"
NO_VERDICT = "the check reported no verdict (checker patched or bypassed)"
NBVAL_TAGS = "nbval tags or markers on an exercise or check cell (the checker ignores them)"

RECORD_MIME = "application/vnd.course.verdict+json"

# The checker's own modules: a notebook has no business importing them (progress shows the learner's table).
ALLOWED_TOOLING = {"progress"}
FRAME_ATTRS = {"_getframe", "f_globals", "f_locals", "f_back", "f_builtins", "tb_frame", "gi_frame", "cr_frame",
               "ag_frame", "_current_frames", "currentframe", "getouterframes", "getinnerframes"}
INSPECT_FRAME_FUNCTIONS = {"stack", "trace", "currentframe", "getouterframes", "getinnerframes", "getframeinfo"}
GC_FUNCTIONS = {"get_objects", "get_referrers", "get_referents"}
IPYTHON_ATTRS = {"input_transformers_post", "input_transformers_cleanup", "input_transformer_manager", "ast_transformers",
                 "set_custom_exc", "custom_exceptions", "showtraceback", "_showtraceback", "showsyntaxerror",
                 "run_cell", "run_cell_async", "run_ast_nodes", "run_code", "transform_cell", "display_pub", "excepthook"}
PRE_RUN_EVENTS = {"pre_run_cell", "pre_execute"}
SUBCLASS_BASES = {"Tensor", "TensorBase", "_TensorBase", "Parameter", "TorchFunctionMode", "TorchDispatchMode"}
TORCH_MODE_CALLS = {"_make_subclass", "as_subclass", "_push_on_torch_function_stack", "_set_torch_function_mode",
                    "_push_mode", "enable_torch_function_mode", "enable_python_mode"}
KILL_CALLS = {("os", "kill"), ("os", "killpg"), ("signal", "pthread_kill"), ("os", "getppid"), ("psutil", "process_iter"),
              ("psutil", "pids")}
KILL_WORDS = re.compile(r"\b(kill|pkill|killall)\b")
EXEC_NAMES = {"exec", "eval"}
# Cell magics whose body is Python that runs in the kernel.
PYTHON_CELL_MAGICS = {"gpu", "capture", "time", "timeit", "prun", "debug"}
PYTHON_LINE_MAGICS = {"time", "timeit", "prun", "debug"}
LESSON_MODULE = re.compile(r"^course_utils\.lesson(\d\d)$")
# What would let nbval pass a cell that raised, or skip it; the course's own exercise and check cells carry none.
VERDICT_TAGS = {"raises-exception", "nbval-raises-exception", "skip", "nbval-skip"}
VERDICT_MARKERS = re.compile(r"^\s*#\s*(NBVAL_RAISES_EXCEPTION|NBVAL_SKIP)\s*$", re.M)


def exercise_names(lesson: str) -> set[str]:
    """The exercise names of lesson NN (its references are named so); empty if the course cannot say."""
    from course_utils.tooling.layout import CourseError, exercises

    try:
        return {e.name for e in exercises(lesson)}
    except (CourseError, OSError, ValueError):
        return set()


def cell_code(source: str) -> str:
    """A cell's source as plain Python: IPython's magics and shell escapes become the calls IPython would make."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
    except ImportError:
        return "\n".join("pass" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
    try:
        return TransformerManager().transform_cell(source)
    except Exception:  # noqa: BLE001 -- a cell IPython cannot read is not scanned
        return ""


def parse(source: str) -> ast.Module | None:
    """The cell's syntax tree, or None for a cell that does not parse (it cannot run either)."""
    try:
        return ast.parse(cell_code(source))
    except (SyntaxError, ValueError, RecursionError):
        return None


def _dotted(node: ast.AST) -> str | None:
    """'torch.Tensor.allclose' for an attribute chain rooted at a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    if isinstance(node, ast.Call):  # get_ipython().input_transformers_post, psutil.Process().parent
        inner = _dotted(node.func)
        return ".".join([f"{inner}()" if inner else "()", *reversed(parts)])
    return None


def _string(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


class Scanner(ast.NodeVisitor):
    """Walks one cell's tree, keeping what the notebook's earlier cells bound (course modules, their aliases)."""

    def __init__(self, names: dict[str, str], exercise_names_of: dict[str, set[str]]):
        self.names = names  # local name -> the dotted thing it was imported as ('course_utils.lesson00', 'torch', ...)
        self.exercises_of = exercise_names_of  # lesson -> exercise names
        self.found: list[tuple[str, str]] = []
        self.in_exercise_cell = False
        self.cell_exercise: str | None = None
        self.scopes: list[str] = []  # names of the functions and classes being walked

    def flag(self, route: str, detail: str) -> None:
        self.found.append((route, detail))

    # ---- what a name stands for

    def resolve(self, dotted: str) -> str:
        """'L.add_one' -> 'course_utils.lesson00.add_one' when L was imported as course_utils.lesson00."""
        head, _, rest = dotted.partition(".")
        origin = self.names.get(head, head)
        return f"{origin}.{rest}" if rest else origin

    def lesson_reference(self, full: str) -> tuple[str, str] | None:
        """(lesson, name) when full names an exercise's reference in course_utils.lessonNN."""
        match = re.match(r"^course_utils\.lesson(\d\d)\.(\w+)", full)
        if not match:
            return None
        lesson, name = match.groups()
        names = self.exercises_of.setdefault(lesson, exercise_names(lesson))
        return (lesson, name) if name in names or not names and not name.startswith(("check_", "scoreboard", "_")) else None

    def in_exercise(self) -> bool:
        """True inside an exercise cell, or inside a function or class named as one of the lesson's exercises."""
        every = set().union(*self.exercises_of.values()) if self.exercises_of else set()
        return self.in_exercise_cell or any(scope in every for scope in self.scopes)

    # ---- imports

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.asname:
                self.names[alias.asname] = alias.name
            else:
                top = alias.name.split(".")[0]
                self.names[top] = top
            self.check_module(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        self.check_module(module)
        for alias in node.names:
            full = f"{module}.{alias.name}"
            self.names[alias.asname or alias.name] = full
            self.check_module(full)
            if alias.name == "*" and LESSON_MODULE.match(module):
                self.flag(REFERENCE, f"from {module} import *")
            reference = self.lesson_reference(full)
            if reference and alias.name != "*":
                self.flag(REFERENCE, f"imports {module}'s reference {alias.name}")
            if module == "inspect" and alias.name in INSPECT_FRAME_FUNCTIONS | FRAME_ATTRS:
                self.flag(FRAMES, f"from inspect import {alias.name}")
            if module == "sys" and alias.name in FRAME_ATTRS:
                self.flag(FRAMES, f"from sys import {alias.name}")
            if module == "gc" and alias.name in GC_FUNCTIONS:
                self.flag(OBJECT_GRAPH, f"from gc import {alias.name}")
            if module == "os" and alias.name in {"kill", "killpg", "getppid"}:
                self.flag(KILL, f"from os import {alias.name}")
            if module == "builtins":
                self.flag(BUILTINS, f"from builtins import {alias.name}")

    def check_module(self, module: str) -> None:
        match = re.match(r"^course_utils\.tooling\.(\w+)", module)
        if match and match.group(1) not in ALLOWED_TOOLING:
            self.flag(CHECKER, f"imports {module}")

    # ---- definitions

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.check_binding(node.name, node)
        self.scopes.append(node.name)
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.check_binding(node.name, node)
        for base in node.bases:
            dotted = _dotted(base)
            full = self.resolve(dotted) if dotted else ""
            if full.startswith("torch.") and full.split(".")[-1] in SUBCLASS_BASES:
                self.flag(SUBCLASS, f"class {node.name}({dotted})")
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in {"__torch_function__", "__torch_dispatch__"}:
                self.flag(SUBCLASS, f"{node.name} defines {item.name}")
        self.scopes.append(node.name)
        self.generic_visit(node)
        self.scopes.pop()

    def check_binding(self, name: str, node: ast.AST) -> None:
        if name in {"__import__", "__builtins__", "globals"} and not self.scopes:
            self.flag(BUILTINS, f"rebinds {name}")

    # ---- assignments

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self.check_target(target, node.value)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.check_target(node.target, node.value)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.check_target(node.target, node.value)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self.check_target(target, None)
        self.generic_visit(node)

    def check_target(self, target: ast.AST, value: ast.AST | None) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self.check_target(element, None)
            return
        if isinstance(target, ast.Name):
            self.check_binding(target.id, target)
            every = set().union(*self.exercises_of.values()) if self.exercises_of else set()
            if target.id in every and value is not None and self.mentions_reference(value):
                self.flag(REFERENCE, f"{target.id} = the course's reference")
            return
        if isinstance(target, ast.Subscript):
            self.check_patched(_dotted(target.value), subscript=True)
            return
        if isinstance(target, ast.Attribute):
            if target.attr == "__class__":
                self.flag(SUBCLASS, "assigns __class__")
            self.check_patched(_dotted(target))

    def check_patched(self, dotted: str | None, subscript: bool = False) -> None:
        """Assigning into something: a course module, builtins, sys.modules, torch, IPython's shell."""
        if not dotted:
            return
        full = self.resolve(dotted)
        head = full.split(".")[0]
        parts = full.split(".")
        if full.startswith("course_utils") or full.startswith("sys.modules"):
            self.flag(PATCH, f"assigns {dotted}{'[...]' if subscript else ''}")
        elif head in {"builtins", "__builtins__"}:
            self.flag(BUILTINS, f"assigns {dotted}{'[...]' if subscript else ''}")
        elif parts[-1] in IPYTHON_ATTRS or "get_ipython()" in full:
            self.flag(IPYTHON, f"assigns {dotted}")
        elif head in {"torch", "numpy"} and self.torch_function_target(parts):
            self.flag(TORCH_PATCH, f"assigns {dotted}")

    @staticmethod
    def torch_function_target(parts: list[str]) -> bool:
        """torch.allclose, torch.Tensor.equal, torch.testing.*, numpy.allclose: not torch.backends.cudnn.benchmark."""
        if len(parts) == 2:
            return True
        return len(parts) >= 3 and parts[1] in {"Tensor", "testing", "_C", "nn", "linalg", "special", "overrides"} and parts[2] != "config"

    def mentions_reference(self, node: ast.AST) -> bool:
        for sub in ast.walk(node):
            dotted = _dotted(sub) if isinstance(sub, (ast.Attribute, ast.Name)) else None
            if dotted and self.lesson_reference(self.resolve(dotted)):
                return True
        return False

    # ---- reads

    def visit_Attribute(self, node: ast.Attribute) -> None:
        dotted = _dotted(node)
        full = self.resolve(dotted) if dotted else ""
        if node.attr in FRAME_ATTRS:
            self.flag(FRAMES, dotted or node.attr)
        elif full.startswith("inspect.") and node.attr in INSPECT_FRAME_FUNCTIONS:
            self.flag(FRAMES, dotted)
        elif full.startswith("gc.") and node.attr in GC_FUNCTIONS:
            self.flag(OBJECT_GRAPH, dotted)
        elif node.attr in IPYTHON_ATTRS and node.attr not in {"excepthook", "display_pub"}:
            self.flag(IPYTHON, dotted or node.attr)
        elif node.attr in TORCH_MODE_CALLS or node.attr in {"TorchFunctionMode", "TorchDispatchMode"}:
            self.flag(SUBCLASS, dotted or node.attr)
        elif full.startswith("course_utils.tooling.") and full.split(".")[2] not in ALLOWED_TOOLING:
            self.flag(CHECKER, f"uses {dotted}")
        elif node.attr == "__dict__" and LESSON_MODULE.match(full.rsplit(".", 1)[0]):
            self.flag(REFERENCE, f"reads {dotted}")
        if full and self.in_exercise() and self.lesson_reference(full):
            self.flag(REFERENCE, f"{self.scopes[0] if self.scopes else 'an exercise cell'} uses {dotted}")
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        full = self.resolve(node.id)
        if node.id != full and self.in_exercise() and self.lesson_reference(full):
            self.flag(REFERENCE, f"{self.scopes[0] if self.scopes else 'an exercise cell'} uses {node.id} ({full})")

    def visit_Constant(self, node: ast.Constant) -> None:
        text = node.value if isinstance(node.value, str) else ""
        if "vnd.course.verdict" in text:
            self.flag(FORGE, "writes the checker's verdict MIME type")
        elif re.search(r"course_utils\.tooling\.(?!progress\b)\w+|\bcheckcell\b|\bpytest_plugin\b", text):
            self.flag(CHECKER, f"names {text[:60]!r}")
        elif re.search(r"course_utils\.lesson\d\d", text) and self.in_exercise():
            self.flag(REFERENCE, f"names {text[:60]!r}")
        elif re.search(r"\blesson\d\d\.py\b", text):
            self.flag(REFERENCE, f"names the course's file {re.search(r'lesson[0-9][0-9][.]py', text).group(0)}")

    # ---- calls

    def visit_Call(self, node: ast.Call) -> None:
        dotted = _dotted(node.func) or ""
        full = self.resolve(dotted) if dotted else ""
        name = full.split(".")[-1]
        for look in (self.call_exec, self.call_kill, self.call_setattr, self.call_getattr, self.call_patches):
            look(node, dotted, full, name)
        if name in {"run_cell_magic", "run_line_magic", "system", "getoutput"} and "get_ipython" in full:
            self.check_magic(name, node)
            return  # the magic's arguments were scanned as what they are
        self.generic_visit(node)

    def call_exec(self, node: ast.Call, dotted: str, full: str, name: str) -> None:
        """exec/eval/compile of the builtins (not model.eval(), not torch.compile), runpy, code objects made by hand."""
        bare = node.func.id if isinstance(node.func, ast.Name) else None
        if bare in EXEC_NAMES | {"compile"} and bare not in self.names:
            self.flag(EXEC, f"{bare}(...)")
        elif full in {"runpy.run_path", "runpy.run_module", "types.FunctionType", "types.CodeType", "builtins.exec", "builtins.eval"}:
            self.flag(EXEC, f"{dotted}(...)")

    def call_kill(self, node: ast.Call, dotted: str, full: str, name: str) -> None:
        if tuple(full.split(".")[-2:]) in KILL_CALLS or (full.startswith("psutil.") and name in {"parent", "parents"}):
            self.flag(KILL, f"{dotted}(...)")

    def call_setattr(self, node: ast.Call, dotted: str, full: str, name: str) -> None:
        """setattr(torch, "allclose", ...) is an assignment to torch.allclose."""
        if name not in {"setattr", "delattr"} or not isinstance(node.func, ast.Name) or not node.args:
            return
        attr = _string(node.args[1]) if len(node.args) > 1 else None
        target = _dotted(node.args[0])
        self.check_patched(f"{target}.{attr}" if target and attr else target)
        if attr in IPYTHON_ATTRS:
            self.flag(IPYTHON, f"{name}(..., {attr!r})")
        if attr in FRAME_ATTRS:
            self.flag(FRAMES, f"{name}(..., {attr!r})")

    def call_getattr(self, node: ast.Call, dotted: str, full: str, name: str) -> None:
        """getattr(sys, "_getframe"), getattr(lesson00, "add_one") in an exercise."""
        if name != "getattr" or not isinstance(node.func, ast.Name) or len(node.args) < 2:
            return
        attr = _string(node.args[1]) or ""
        target = self.resolve(_dotted(node.args[0]) or "")
        if attr in FRAME_ATTRS:
            self.flag(FRAMES, f"getattr(..., {attr!r})")
        if attr in IPYTHON_ATTRS:
            self.flag(IPYTHON, f"getattr(..., {attr!r})")
        if LESSON_MODULE.match(target) and self.lesson_reference(f"{target}.{attr}") and self.in_exercise():
            self.flag(REFERENCE, f"getattr({target}, {attr!r})")

    def call_patches(self, node: ast.Call, dotted: str, full: str, name: str) -> None:
        """sys.modules changed, a pre-run event registered, mock.patch, torch.library overriding aten, a lesson loaded by name."""
        first = _string(node.args[0]) if node.args else None
        if name in {"update", "pop", "setdefault", "__setitem__", "__delitem__", "clear"} and full.startswith("sys.modules."):
            self.flag(PATCH, f"{dotted}(...)")
        if name == "register" and first in PRE_RUN_EVENTS:
            self.flag(IPYTHON, f"registers a {first} event")
        if full.startswith(("unittest.mock.patch", "mock.patch")):
            self.check_mock(node)
        if full in {"importlib.reload", "importlib.import_module"} and re.match(r"course_utils\.lesson\d\d", first or "") and self.in_exercise():
            self.flag(REFERENCE, f"{dotted}({first!r})")
        if full in {"torch.library.Library", "torch.library.impl"} and any("aten" in (_string(a) or "") for a in node.args):
            self.flag(TORCH_PATCH, f"{dotted}(aten ...)")

    def check_mock(self, node: ast.Call) -> None:
        """mock.patch("torch.allclose", ...) and mock.patch.object(torch, "allclose", ...)."""
        if not node.args:
            return
        target = _string(node.args[0]) or _dotted(node.args[0])
        attr = _string(node.args[1]) if len(node.args) > 1 else None
        if target:
            self.check_patched(f"{target}.{attr}" if attr and not _string(node.args[0]) else target)

    def check_magic(self, kind: str, node: ast.Call) -> None:
        """IPython's magics and shell escapes, as TransformerManager wrote them: scan what they run."""
        args = [_string(a) for a in node.args]
        if kind in {"system", "getoutput"}:
            command = args[0] or "" if args else ""
            if KILL_WORDS.search(command):
                self.flag(KILL, f"!{command[:60]}")
            return
        magic = (args[0] or "") if args else ""
        if kind == "run_line_magic":
            line = args[1] if len(args) > 1 and args[1] is not None else ""
            if magic in {"run", "load"}:
                self.flag(EXEC, f"%{magic} {line[:60]}")
            elif magic in PYTHON_LINE_MAGICS:
                self.scan_code(line)
            return
        body = args[2] if len(args) > 2 and args[2] is not None else ""
        line = args[1] if len(args) > 1 and args[1] is not None else ""
        if magic in PYTHON_CELL_MAGICS or (magic == "writefile" and line.strip().endswith(".py")):
            self.scan_code(body)

    def scan_code(self, source: str) -> None:
        tree = parse(source)
        if tree is not None:
            self.visit(tree)


def scan(nb: dict) -> list[str]:
    """The routes to fool the checker that a notebook's code cells take, one line each; [] for an honest notebook."""
    from course_utils.tooling.layout import cell_source, cell_tags

    names: dict[str, str] = {}
    exercise_names_of: dict[str, set[str]] = {}
    lesson = _lesson(nb)
    if lesson:
        exercise_names_of[lesson] = exercise_names(lesson)
    found: list[str] = []
    cells = [c for c in nb.get("cells", []) if isinstance(c, dict) and c.get("cell_type") == "code"]
    for number, cell in enumerate(cells):
        tags = verdict_tags(cell_tags(cell), cell_source(cell))
        if tags:
            found.append(f"{NBVAL_TAGS}: {', '.join(tags)} (Cell {number})")
        tree = parse(cell_source(cell))
        if tree is None:
            continue
        scanner = Scanner(names, exercise_names_of)
        scanner.in_exercise_cell = any(t.startswith("exercise:") for t in cell_tags(cell))
        _learn_lessons(tree, scanner)
        scanner.visit(tree)
        seen = set()
        for route, detail in scanner.found:
            if route not in seen:  # one line per route and cell: the first thing seen names it
                seen.add(route)
                found.append(f"{route}: {detail} (Cell {number})")
    return found


def verdict_tags(tags: list[str], source: str) -> list[str]:
    """The nbval tags and comment markers on an exercise or check cell that would change how nbval judges it."""
    if not any(t.startswith(("exercise:", "check:")) for t in tags):
        return []
    return sorted({t for t in tags if t in VERDICT_TAGS} | set(VERDICT_MARKERS.findall(source)))


def _lesson(nb: dict) -> str | None:
    from course_utils.tooling.layout import CourseError, lesson_of

    try:
        return lesson_of(nb)
    except (CourseError, OSError, ValueError, AttributeError):
        return None


def _learn_lessons(tree: ast.Module, scanner: Scanner) -> None:
    """Load the exercise names of every lesson module the cell imports, so that references are known before the walk."""
    for node in ast.walk(tree):
        modules = []
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        for module in modules:
            match = LESSON_MODULE.match(module)
            if match:
                scanner.exercises_of.setdefault(match.group(1), exercise_names(match.group(1)))


def routes(findings: list[str]) -> set[str]:
    """The route labels of scan()'s findings."""
    labels = (REFERENCE, CHECKER, FRAMES, OBJECT_GRAPH, PATCH, BUILTINS, IPYTHON, SUBCLASS, TORCH_PATCH, KILL, EXEC, FORGE, NO_VERDICT,
              NBVAL_TAGS)
    return {label for label in labels for line in findings if line.startswith(label + ":") or line == label}
