"""What the checker runs in place of a learner's check cell: the course's own check, on the learner's function.

Under nbval with the course's plugin, each check cell's text is replaced by a call of `run`. It
evaluates the check cell as the course's copy of the lesson writes it, against a fresh copy of
the lesson's module (and of the checks and verdicts it imports) loaded from its file. So a
learner's cell that rebinds `lesson01`, reassigns `lesson01.check_linear`, or patches
`verdicts.checker_running` cannot change the verdict: only the learner's functions, looked up
by name in their namespace, come from the notebook.

The verdict then goes back to the plugin as a record in the cell's output (a display with the
private MIME type tamper.RECORD_MIME, holding the nonce the plugin put into the cell), which is
the only thing the plugin takes as a pass. Before the check, `run` also looks for the cheap ways
to fool it from inside the kernel: an answer that is the course's own reference, or that reads
the checker's frames, fails; torch's comparisons patched fails; patched checker modules, IPython
hooks and the like are named in the record's "review" list for an instructor.
"""

import ast
import builtins
import functools
import importlib.util
import os
import re
import sys
import types
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

from course_utils.tooling import checks, tamper
from course_utils.tooling.layout import exercises

_FRESH: dict[str, tuple[tuple[float, ...], ModuleType]] = {}
PACKAGE = Path(checks.__file__).resolve().parents[1]
LESSON_FILE = re.compile(r"lesson(\d\d)\.py$")
# torch's functions the comparison helpers judge with: replaced by the learner's code, no verdict can be trusted.
TORCH_COMPARISONS = ("allclose", "equal", "isclose", "isnan", "eq", "ne", "all", "any", "abs", "sort")
TENSOR_COMPARISONS = ("allclose", "equal", "isclose", "isnan", "eq", "ne", "__eq__", "__ne__", "__bool__", "all", "any",
                      "item", "tolist", "detach", "to", "float", "abs", "sort", "flatten", "numel", "is_complex", "cpu")
MAX_CODE_OBJECTS = 200  # how much of the learner's code one answer's scan follows


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fresh_lesson(lesson: str) -> ModuleType:
    """lessonNN as its file defines it, with fresh copies of the verdicts and checks it imports (cached while no file changes)."""
    paths = {
        "course_utils.tooling.verdicts": PACKAGE / "tooling" / "verdicts.py",
        "course_utils.tooling.checks": PACKAGE / "tooling" / "checks.py",
        f"course_utils.lesson{lesson}": PACKAGE / f"lesson{lesson}.py",
    }
    stamp = tuple(path.stat().st_mtime for path in paths.values())
    cached = _FRESH.get(lesson)
    if cached and cached[0] == stamp:
        return cached[1]
    saved = {name: sys.modules.get(name) for name in paths}
    loaded = {}
    try:
        # Each module's `from course_utils.tooling.... import ...` must find the fresh copy before it.
        for name, path in paths.items():
            sys.modules[name] = loaded[name] = _load(name, path)
    finally:
        for name, original in saved.items():
            if original is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = original
    module = loaded[f"course_utils.lesson{lesson}"]
    module._fresh_checks = loaded["course_utils.tooling.checks"]
    module._fresh_verdicts = loaded["course_utils.tooling.verdicts"]
    _FRESH[lesson] = (stamp, module)
    return module


def run(lesson: str, exercise: str, namespace: dict, nonce: str | None = None) -> None:
    """Run the course's check cell of `exercise` against the learner's namespace; with a nonce, publish the verdict's record."""
    (wanted,) = [e for e in exercises(lesson) if e.name == exercise]
    module = fresh_lesson(lesson)
    fresh_checks = module._fresh_checks
    fault, review = _inspected(lesson, exercise, wanted.check_source, namespace)
    review += _safely(environment_review, lesson, namespace) or []
    fault = untrusted_torch() or fault
    original_report = fresh_checks.report

    def report(verdict) -> None:
        late = (untrusted_torch() or subclass_fault()) if verdict.status == "passed" else None
        if late:  # the answer patched torch while the check ran, so its comparisons cannot be trusted
            review.append(late[1])
            verdict = module._fresh_verdicts.Verdict(exercise, "failed", late[0])
        publish(verdict, nonce, review)
        original_report(verdict)

    fresh_checks.report = report  # the decorator's wrapper reports through this module global
    try:
        if fault:
            reason, route = fault
            review.append(route)
            _report(lesson, fresh_checks, module._fresh_verdicts.Verdict(exercise, "failed", reason))
            return
        scope = {**namespace, f"lesson{lesson}": module}
        code = compile(wanted.check_source, f"<course check {exercise}>", "exec")
        try:
            exec(code, scope)
        except NameError as err:
            # The check cell names the learner's function; a NameError here means it was never defined,
            # or the cell that defines it raised before it got that far.
            failed_cell = _safely(_unbound_failure, err.name, namespace)
            reason = failed_cell if isinstance(failed_cell, str) else (
                f"{err.name} is not defined: run the cell that defines it (was it renamed or deleted?)")
            _report(lesson, fresh_checks, module._fresh_verdicts.Verdict(exercise, "failed", reason))
    finally:
        fresh_checks.report = original_report


def _unbound_failure(name: str, namespace: dict) -> str | None:
    """The message for a name that its cell's failed run left undefined (course_utils.tooling.cellruns), or None."""
    from course_utils.tooling.cellruns import failure_of_unbound

    failure = failure_of_unbound(name, namespace)
    return failure.message() if failure is not None else None


def _safely(look: Any, *args: Any) -> Any:
    """An advisory look at the kernel: whatever odd object it meets there, it must never break an honest check."""
    try:
        return look(*args)
    except Exception:  # noqa: BLE001
        return None


def _inspected(lesson: str, exercise: str, check_source: str, namespace: dict) -> tuple[tuple[str, str] | None, list[str]]:
    """(answer_fault(), []); an answer built to make the inspection itself fail is named for review, and judged as usual."""
    try:
        return answer_fault(lesson, exercise, check_source, namespace), []
    except Exception as err:  # noqa: BLE001
        return None, [f"{tamper.REFERENCE}: the answer of {exercise} could not be inspected ({type(err).__name__})"]


def _report(lesson: str, fresh_checks: ModuleType, verdict: Any) -> None:
    from course_utils.tooling.progress import record

    record(lesson, verdict)
    fresh_checks.report(verdict)


def publish(verdict: Any, nonce: str | None, review: list[str]) -> None:
    """Hand the verdict to the plugin: a display that only the checker reads (JupyterLab has no renderer for it, so shows nothing)."""
    if nonce is None or not _in_ipython():
        return
    from IPython.display import display

    record = {"exercise": verdict.exercise, "status": verdict.status, "reason": verdict.reason, "nonce": nonce,
              "review": list(review)}
    display({tamper.RECORD_MIME: record}, raw=True)


def _in_ipython() -> bool:
    ipython = sys.modules.get("IPython")
    return ipython is not None and ipython.get_ipython() is not None


# ---------------------------------------------------------------- the answer itself

def answer_fault(lesson: str, exercise: str, check_source: str, namespace: dict) -> tuple[str, str] | None:
    """(reason, review route) when an answer named in the check cell is, calls, or digs out the course's reference."""
    for name in _answer_names(check_source, lesson):
        if name not in namespace:
            continue  # the check itself says it is not defined
        answer = namespace[name]
        origin = reference_origin(answer)
        if origin:
            module = origin.rsplit(".", 1)[0]
            return (f"your {name} is the course's reference, imported from {module}: write your own",
                    f"{tamper.REFERENCE}: {name} is {origin}")
        found = code_fault(name, answer)
        if found:
            return found
    return None


def _answer_names(check_source: str, lesson: str) -> list[str]:
    """The names the check cell passes to the check: `lesson01.check_linear(linear)` -> ['linear']."""
    names = []
    for node in ast.walk(ast.parse(check_source)):
        if isinstance(node, ast.Name) and node.id != f"lesson{lesson}" and node.id not in names:
            names.append(node.id)
    return names


def _lesson_file(code_file: str) -> str | None:
    """'00' for a code object of course_utils/lesson00.py."""
    path = Path(code_file)
    match = LESSON_FILE.search(path.name)
    try:
        inside = path.resolve().parent == PACKAGE
    except OSError:
        inside = False
    return match.group(1) if match and inside else None


def _unwrap(obj: Any) -> Any:
    """The function behind a partial, a bound method, a static or class method, a functools.wraps wrapper."""
    for _ in range(10):
        inner = obj.func if isinstance(obj, functools.partial) else None
        inner = inner or getattr(obj, "__func__", None) or getattr(obj, "__wrapped__", None)
        if inner is None or inner is obj:
            return obj
        obj = inner
    return obj


def reference_origin(answer: Any) -> str | None:
    """'course_utils.lesson00.add_one' when the answer is an object of the course's lesson files (a function, a class, an instance)."""
    obj = _unwrap(answer)
    code = getattr(obj, "__code__", None)
    if code is not None and _lesson_file(code.co_filename):
        return f"course_utils.lesson{_lesson_file(code.co_filename)}.{getattr(obj, '__qualname__', code.co_name)}"
    kind = obj if isinstance(obj, type) else type(obj)
    module = sys.modules.get(getattr(kind, "__module__", ""), None)
    file = getattr(module, "__file__", None) or ""
    if _lesson_file(file) and re.fullmatch(r"course_utils\.lesson\d\d", kind.__module__ or ""):
        return f"{kind.__module__}.{kind.__qualname__}"
    return None


def code_fault(name: str, answer: Any) -> tuple[str, str] | None:
    """(reason, route) when the answer's own code reads the checker's frames or calls the course's reference."""
    for code, scope in learner_code(answer):
        names = set(code.co_names)
        words = names | {c for c in code.co_consts if isinstance(c, str)}  # getattr(sys, "_getframe") names it in a string
        frames = sorted(words & tamper.FRAME_ATTRS)
        if not frames and names & tamper.INSPECT_FRAME_FUNCTIONS and _is_module(scope, names, "inspect"):
            frames = sorted(names & tamper.INSPECT_FRAME_FUNCTIONS)
        if frames:
            return (f"your {name} reads the checker's stack frames ({', '.join(frames)}): write your own code",
                    f"{tamper.FRAMES}: {name} uses {', '.join(frames)}")
        if words & tamper.GC_FUNCTIONS and _is_module(scope, names, "gc"):
            found = ", ".join(sorted(words & tamper.GC_FUNCTIONS))
            return (f"your {name} searches the interpreter's objects (gc.{found}): write your own code",
                    f"{tamper.OBJECT_GRAPH}: {name} uses gc.{found}")
        used = _reference_used(names, words, scope)
        if used:
            return (f"your {name} calls the course's reference {used}: write your own",
                    f"{tamper.REFERENCE}: {name} calls {used}")
    return None


def _global(scope: dict, name: str) -> Any:
    return scope[name] if name in scope else getattr(builtins, name, None)


def _is_module(scope: dict, names: set[str], module: str) -> bool:
    return any(isinstance(_global(scope, n), ModuleType) and _global(scope, n).__name__ == module for n in names)


def _lesson_modules(names: set[str], words: set[str], scope: dict) -> list[str]:
    """The course_utils.lessonNN modules a code object reaches: imported in it, named in a string, or a global bound to one."""
    found = [w for w in words if re.fullmatch(r"course_utils\.lesson\d\d", w)]
    found += [v.__name__ for n in names if isinstance(v := _global(scope, n), ModuleType)
              and re.fullmatch(r"course_utils\.lesson\d\d", v.__name__)]
    return sorted(set(found))


def _reference_used(names: set[str], words: set[str], scope: dict) -> str | None:
    """'course_utils.lesson00.add_one' when the code reaches an exercise's reference through a lesson module or a global bound to it."""
    for module in _lesson_modules(names, words, scope):
        hit = sorted(words & {e.name for e in _exercises(module[-2:])})
        if hit:
            return f"{module}.{hit[0]}"
    for global_name in sorted(names):
        value = _global(scope, global_name)
        origin = reference_origin(value) if callable(value) and not isinstance(value, ModuleType) else None
        if origin and origin.rsplit(".", 1)[1] in {e.name for e in _exercises(origin.split(".")[1][6:])}:
            return origin
    return None


def _exercises(lesson: str) -> list:
    try:
        return exercises(lesson)
    except Exception:  # noqa: BLE001 -- a lesson that is not the course's has no references
        return []


def _is_learner_function(function: Any) -> bool:
    """A function of the learner's: defined in the notebook (or a string it exec'd there), or in a module of the learner's."""
    if not isinstance(getattr(function, "__code__", None), types.CodeType):
        return False
    return _is_learner_module(getattr(function, "__module__", None))


def _is_learner_class(kind: type) -> bool:
    return _is_learner_module(getattr(kind, "__module__", None))


def _is_learner_module(name: str | None) -> bool:
    return checks.learner_module(name)


def learner_code(answer: Any) -> Iterator[tuple[types.CodeType, dict]]:
    """Every code object of the learner's that the answer can run: its own, nested ones, its class's methods, the helpers it names."""
    todo, seen, count = [answer], set(), 0
    while todo and count < MAX_CODE_OBJECTS:
        obj = _unwrap(todo.pop())
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        for code, scope in _codes_of(obj):
            for nested in _nested(code):
                count += 1
                yield nested, scope
                for name in nested.co_names:  # the learner's helpers that this code names
                    if name in scope and _defined_by_learner(scope[name]):
                        todo.append(scope[name])


def _codes_of(obj: Any) -> list[tuple[types.CodeType, dict]]:
    """The learner's code objects of a function, or of the learner's classes in an object's (or class's) MRO."""
    if isinstance(getattr(obj, "__code__", None), types.CodeType):
        return [(obj.__code__, getattr(obj, "__globals__", {}))] if _is_learner_function(obj) else []
    kind = obj if isinstance(obj, type) else type(obj)
    found = []
    for cls in getattr(kind, "__mro__", ()):
        if not _is_learner_class(cls):
            continue
        for member in vars(cls).values():
            for part in (member, getattr(member, "fget", None), getattr(member, "fset", None)):
                function = _unwrap(part) if part is not None else None
                if _is_learner_function(function):
                    found.append((function.__code__, function.__globals__))
    return found


def _nested(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested(const)


def _defined_by_learner(value: Any) -> bool:
    value = _unwrap(value)
    return _is_learner_function(value) or (isinstance(value, type) and _is_learner_class(value))


# ---------------------------------------------------------------- the kernel around the check

def untrusted_torch() -> tuple[str, str] | None:
    """(reason, route) when the learner's code replaced a torch comparison or put a torch function mode on the stack."""
    import torch

    replaced = [f"torch.{n}" for n in TORCH_COMPARISONS if not _library_function(getattr(torch, n, None))]
    replaced += [f"torch.Tensor.{n}" for n in TENSOR_COMPARISONS if not _library_function(getattr(torch.Tensor, n, None))]
    if replaced:
        return (f"your code replaced {replaced[0]}, which the check compares with: remove that patch",
                f"{tamper.TORCH_PATCH}: {', '.join(replaced)}")
    if torch._C._len_torch_function_stack() > 0 or torch._C._len_torch_dispatch_stack() > 0:
        return ("a torch function mode is active, which would decide every comparison: leave it (`with mode:` scopes one)",
                f"{tamper.SUBCLASS}: a torch function or dispatch mode is active")
    return None


C_CALLABLES = (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
               types.MethodWrapperType, types.ClassMethodDescriptorType, types.GetSetDescriptorType)


def _library_function(obj: Any) -> bool:
    """True for a function of C, or a Python function of a library's (not a lambda, a partial or a class put in its place)."""
    if obj is None or isinstance(obj, C_CALLABLES):
        return True
    function = obj
    while hasattr(function, "__wrapped__"):
        function = function.__wrapped__
    return isinstance(function, types.FunctionType) and not _is_learner_function(function)


def subclass_fault() -> tuple[str, str] | None:
    """(reason, route) when a torch.Tensor subclass of the learner's overrides how tensors compare.

    The comparison helpers refuse such a tensor, but a lesson's own check may compare with
    torch.equal directly; no lesson asks for a tensor subclass, so a pass is not given with one about.
    """
    found = learner_tensor_subclasses()
    return subclass_message(found[0]) if found else None


def subclass_message(kind: type) -> tuple[str, str]:
    """(reason, route) for a learner's tensor subclass that overrides comparisons."""
    overridden = sorted(set(vars(kind)) & OVERRIDES)
    return (f"your code defines {kind.__qualname__}, a torch.Tensor subclass that overrides {overridden[0]}: "
            "the checks compare plain tensors; remove it",
            f"{tamper.SUBCLASS}: class {kind.__qualname__} overrides {', '.join(overridden)}")


OVERRIDES = {"__torch_function__", "__torch_dispatch__", *TENSOR_COMPARISONS}


def learner_tensor_subclasses() -> list[type]:
    """Every torch.Tensor subclass of the learner's that overrides __torch_function__ or a comparison."""
    import torch

    found, todo, seen = [], [torch.Tensor], set()
    while todo:
        for kind in todo.pop().__subclasses__():
            if kind in seen:
                continue
            seen.add(kind)
            todo.append(kind)
            if _is_learner_class(kind) and set(vars(kind)) & OVERRIDES:
                found.append(kind)
    return found


def _genuine(obj: Any) -> bool:
    """False for a hook whose code is the learner's (a function, a method, a callable object of a learner's class)."""
    if obj is None or isinstance(obj, C_CALLABLES):
        return True
    function = _unwrap(obj)
    if isinstance(function, types.FunctionType):
        return not _is_learner_function(function)
    kind = function if isinstance(function, type) else type(function)
    return not _is_learner_class(kind)


def environment_review(lesson: str, namespace: dict) -> list[str]:
    """Routes that do not decide this verdict (the check runs on fresh copies) but that an instructor should see."""
    return [*_checker_drift(lesson), *_import_hooks(namespace), *_ipython_hooks(), *_tensor_subclasses(namespace)]


def _checker_drift(lesson: str) -> list[str]:
    """The checker's modules as the kernel has them, against their fresh copies from the files."""
    fresh = fresh_lesson(lesson)
    pairs = [("course_utils.tooling.verdicts", fresh._fresh_verdicts), ("course_utils.tooling.checks", fresh._fresh_checks),
             (f"course_utils.lesson{lesson}", fresh)]
    found = []
    for name, copy in pairs:
        live = sys.modules.get(name)
        if live is None:
            continue
        if not isinstance(live, ModuleType) or not _same_file(getattr(live, "__file__", None), copy.__file__):
            found.append(f"{tamper.PATCH}: sys.modules[{name!r}] replaced")
            continue
        changed = _drift(live, copy)
        if changed:
            found.append(f"{tamper.PATCH}: {name}.{changed[0]}" + (f" and {len(changed) - 1} more" if len(changed) > 1 else ""))
    this = sys.modules.get(__name__)
    if this is not None and getattr(this, "run", None) is not run:
        found.append(f"{tamper.PATCH}: {__name__}.run")
    return found


def _same_file(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def _same_code(a: Any, b: Any) -> bool:
    a, b = getattr(a, "__code__", None), getattr(b, "__code__", None)
    return (a is not None and b is not None and (a.co_firstlineno, a.co_code) == (b.co_firstlineno, b.co_code)
            and (a.co_filename == b.co_filename or _same_file(a.co_filename, b.co_filename)))


def _drift(live: ModuleType, copy: ModuleType) -> list[str]:
    """The names of functions and class members of `copy` that `live` no longer has as its file defines them."""
    changed = []
    for name, value in vars(copy).items():
        if name.startswith("__"):
            continue  # torch.compile adds its compiled functions to the globals of the code it compiles
        mine = vars(live).get(name)
        if isinstance(value, types.FunctionType) and value.__module__ == copy.__name__:
            if not _same_code(mine, value):
                changed.append(name)
        elif isinstance(value, type) and value.__module__ == copy.__name__:
            if not isinstance(mine, type):
                changed.append(name)
                continue
            changed += [f"{name}.{member}" for member in _class_drift(mine, value)]
    return changed


def _class_drift(live: type, copy: type) -> list[str]:
    ours, theirs = vars(copy), vars(live)
    added = set(theirs) - set(ours)
    changed = sorted(m for m in added if isinstance(theirs[m], (types.FunctionType, property, staticmethod, classmethod)))
    for member, value in ours.items():
        mine = theirs.get(member)
        if isinstance(value, property):
            if not (isinstance(mine, property) and _same_code(mine.fget, value.fget)):
                changed.append(member)
        elif isinstance(value, types.FunctionType) and not _same_code(mine, value):
            changed.append(member)
    return changed


def _import_hooks(namespace: dict) -> list[str]:
    found = []
    if not (isinstance(builtins.__import__, types.BuiltinFunctionType) and getattr(builtins.__import__, "__self__", None) is builtins):
        found.append(f"{tamper.BUILTINS}: builtins.__import__ replaced")
    found += [f"{tamper.BUILTINS}: your notebook defines {n}" for n in ("__import__", "globals") if n in namespace]
    return found


def _ipython_hooks() -> list[str]:
    """Input transformers, AST transformers, custom exception handlers and patched shell methods that are the learner's."""
    if not _in_ipython():
        return []
    shell = sys.modules["IPython"].get_ipython()
    found = []
    for attr in ("input_transformers_cleanup", "input_transformers_post"):
        if any(not _genuine(t) for t in getattr(shell, attr, [])):
            found.append(f"{tamper.IPYTHON}: shell.{attr}")
    if getattr(shell, "ast_transformers", None):
        found.append(f"{tamper.IPYTHON}: shell.ast_transformers")
    if getattr(shell, "custom_exceptions", ()):
        found.append(f"{tamper.IPYTHON}: set_custom_exc")
    for event in tamper.PRE_RUN_EVENTS:
        if any(not _genuine(cb) for cb in getattr(getattr(shell, "events", None), "callbacks", {}).get(event, [])):
            found.append(f"{tamper.IPYTHON}: a {event} event")
    display_pub = getattr(shell, "display_pub", None)
    for owner in (shell, display_pub, *type(shell).__mro__, *type(display_pub).__mro__):
        members = vars(owner).items() if owner is not None and hasattr(owner, "__dict__") else []
        patched = [n for n, v in members if isinstance(v, (types.FunctionType, types.MethodType)) and not _genuine(v)]
        if patched:
            found.append(f"{tamper.IPYTHON}: {getattr(owner, '__name__', type(owner).__name__)}.{patched[0]} replaced")
    return found


def _tensor_subclasses(namespace: dict) -> list[str]:
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    found = []
    for name, value in list(namespace.items()):
        if isinstance(value, type) and _is_learner_class(value):
            if issubclass(value, torch.Tensor) or "__torch_function__" in vars(value) or "__torch_dispatch__" in vars(value):
                found.append(f"{tamper.SUBCLASS}: class {name}")
    return found

