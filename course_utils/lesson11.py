"""Lesson 11 (the capstone): helpers for the notebook, the course's references, and the checks of the learner's
five files: capstone_data.py, capstone_model.py, capstone_train.py, capstone_decode.py and capstone_ship.py.

The learner writes each file with a %%writefile cell; each check receives the file's path, imports it afresh
(never the notebook's copy) and judges what its code does on hidden data. The training script is run on two
real ranks by course_utils.capstone_probe, which records what each rank did.
"""

import ast
import contextlib
import functools
import importlib.util
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.overrides import TorchFunctionMode

from course_utils import addition
from course_utils.addition import DIGITS, END, EQUALS, IGNORE, MAX_ANSWER, MAX_LEN, PAD, PLUS, PROMPT_LEN, VOCAB_SIZE
from course_utils.tooling.checks import (
    ExerciseFailed,
    ExerciseNotAttempted,
    a_type,
    exercise,
    exercise_seconds,
    first_line,
    not_attempted_message,
    scoreboard_for,
    stub_frame,
    untouched_script,
)
from course_utils.tooling.language import _

scoreboard = scoreboard_for(__name__)  # the lesson's last cell: this session's verdicts

FILES = ("capstone_data", "capstone_model", "capstone_train", "capstone_decode", "capstone_ship")


# Helpers for the notebook.

def load(path: str | os.PathLike):
    """Import one of your capstone files afresh (after its %%writefile cell ran again), with the files beside it."""
    path = Path(path).resolve()
    for name in FILES:  # the others import each other by name: they must come from this folder, as they are now
        sys.modules.pop(name, None)
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (avx512_bf16 or amx_bf16, Linux), so that autocast to it is faster."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = set(next((line for line in text.splitlines() if line.startswith("flags")), "").split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    """The checkpoint of the most steps in a run's folder (step_000800.pt), or None when there is none."""
    found = sorted(Path(folder).glob("step_*.pt"))
    return found[-1] if found else None


def demo(fn: Callable):
    """Run a demo that uses your files and return what it returns; where it reaches an untouched stub, or raises,
    print that in place of a traceback and return None, so that the notebook runs on (the checks say what is wrong)."""
    try:
        return fn()
    except NotImplementedError as err:
        stub = stub_frame(err)
        if stub is None:
            raise
        print(f"skipped: {stub[0]} in {Path(stub[1]).name} is not written yet")
    except Exception as err:  # noqa: BLE001 -- the learner's code: shown, not raised
        print(f"your code raised {type(err).__name__}: {_line(err)}{_where_in_learner(err)}")
    return None


class _AttentionRecorder(TorchFunctionMode):
    """Records every attention pattern a forward computes: F.scaled_dot_product_attention's (recomputed from q and k),
    or the softmax over the last dimension of a (N, heads, T, T) score tensor, for attention written by hand."""

    def __init__(self):
        super().__init__()
        self.maps: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            q, k = args[0], args[1]
            scale = kwargs.get("scale") or 1 / math.sqrt(q.shape[-1])
            scores = q.float() @ k.float().transpose(-2, -1) * scale
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            if kwargs.get("is_causal", args[5] if len(args) > 5 else False):
                mask = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
            self.maps.append(scores.softmax(-1).detach())
        elif func in (torch.softmax, F.softmax, torch.Tensor.softmax) and isinstance(out, torch.Tensor) and out.ndim == 4 \
                and out.shape[-1] == out.shape[-2]:
            self.maps.append(out.detach().float())
        return out


class _OpRecorder(TorchFunctionMode):
    """Records, in order, the operations of a forward that reveal the model's structure: the LayerNorms, the Linears
    (their weights' shapes), the attentions (their number of heads) and the MLP's activation."""

    # tanh, sigmoid and erf are left out: a GELU written by hand is made of them
    ACTIVATIONS = {F.gelu: "GELU", F.relu: "ReLU", torch.relu: "ReLU", torch.Tensor.relu: "ReLU", F.silu: "SiLU",
                   F.leaky_relu: "LeakyReLU", F.elu: "ELU", F.mish: "Mish"}

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.layer_norm:
            self.ops.append(("norm",))
        elif func is F.linear:
            self.ops.append(("linear", tuple(args[1].shape)))
        elif func is F.scaled_dot_product_attention:   # heads only where they have a dimension of their own
            self.ops.append(("attention", args[0].shape[-3] if args[0].ndim == 4 else None))
        elif func is F.multi_head_attention_forward:
            self.ops.append(("attention", kwargs.get("num_heads", args[4] if len(args) > 4 else None)))
        elif func in (torch.softmax, F.softmax, torch.Tensor.softmax) and isinstance(out, torch.Tensor) and out.ndim >= 3 \
                and out.shape[-1] == out.shape[-2] > 1:
            self.ops.append(("attention", out.shape[-3] if out.ndim == 4 else None))
        elif func in self.ACTIVATIONS:
            self.ops.append(("activation", self.ACTIVATIONS[func]))
        return out


def _check_structure(model: nn.Module, sizes: dict) -> None:
    """What the prompt states and the logits cannot show: pre-norm blocks, the heads, the MLP's width and GELU, a
    learned position table of max_len positions, and logits (not probabilities)."""
    d, heads, layers = sizes["d_model"], sizes["n_heads"], sizes["n_layers"]
    what = f"TinyGPT({_sizes(sizes, 0.0)})"
    if not any(MAX_LEN in p.shape for p in model.parameters()):
        tables = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding) and m.num_embeddings != VOCAB_SIZE]
        if tables:
            raise ExerciseFailed(_("{what} has a table of {n} positions, expected a learned position embedding of max_len "
                                   "({max_len}) positions").format(what=what, n=tables[0], max_len=MAX_LEN))
        raise ExerciseFailed(_("{what} has no learned table of positions, expected a learned position embedding of max_len "
                               "({max_len}) positions").format(what=what, max_len=MAX_LEN))
    tokens = torch.randint(0, VOCAB_SIZE, (2, 7), generator=torch.Generator().manual_seed(77))
    recorder = _OpRecorder()
    with torch.no_grad(), recorder:
        out = _forward(model, tokens, _("{what} on tokens of shape ({n}, {t})").format(what=what, n=2, t=7))
    if (out >= 0).all() and torch.allclose(out.float().sum(-1), torch.ones(()), atol=1e-3):
        raise ExerciseFailed(_("{what} returned probabilities (each row sums to 1): return the head's logits, without a "
                               "softmax").format(what=what))
    if (out <= 0).all() and torch.allclose(out.float().exp().sum(-1), torch.ones(()), atol=1e-3):
        raise ExerciseFailed(_("{what} returned log-probabilities: return the head's logits, without a log_softmax").format(what=what))
    ops = recorder.ops
    norms = sum(op[0] == "norm" for op in ops)
    first_work = next((i for i, op in enumerate(ops) if op[0] in ("linear", "attention")), None)
    first_norm = next((i for i, op in enumerate(ops) if op[0] == "norm"), None)
    if first_norm is not None and first_work is not None and first_work < first_norm:
        raise ExerciseFailed(_("{what}: the first block computes attention before any LayerNorm: each block is pre-norm, "
                               "x + attention(LayerNorm(x)), then x + mlp(LayerNorm(x))").format(what=what))
    if norms and norms != 2 * layers + 1:   # none seen: LayerNorms written by hand
        raise ExerciseFailed(_("{what} ran {norms} LayerNorms, expected {expected}: two in each of the {layers} blocks "
                               "(before the attention, before the MLP) and a final one before the head").format(
                                   what=what, norms=norms, expected=2 * layers + 1, layers=layers))
    found = {op[1] for op in ops if op[0] == "attention" and op[1] is not None}
    if found and found != {heads}:
        raise ExerciseFailed(_("{what}'s attention runs with {got} head(s), expected n_heads={heads}").format(
            what=what, got=sorted(found)[0], heads=heads))
    activations = [i for i, op in enumerate(ops) if op[0] == "activation"]
    names = {ops[i][1] for i in activations}
    if names and "GELU" not in names:
        raise ExerciseFailed(_("{what}'s MLP uses {activation}, expected GELU: Linear(d, 4d), GELU, Linear(4d, d)").format(
            what=what, activation=sorted(names)[0]))
    for i in activations:
        before = next((op for op in reversed(ops[:i]) if op[0] == "linear"), None)
        if ops[i][1] == "GELU" and before is not None and before[1][0] != 4 * d:
            raise ExerciseFailed(_("{what}'s MLP is {width} wide, expected 4 * d_model = {expected}").format(
                what=what, width=before[1][0], expected=4 * d))


def attention_maps(model: nn.Module, tokens: torch.Tensor) -> list[torch.Tensor]:
    """The attention weights of every layer, (heads, T, T) each, for one sequence of tokens (1-D), in eval mode."""
    recorder = _AttentionRecorder()
    with torch.inference_mode(), recorder:
        model(tokens.view(1, -1))
    return [m[0] for m in recorder.maps]


# The course's references: what the checks compare with.

def encode(a: int, b: int) -> tuple[list[int], list[int]]:
    """(prompt, answer): "0123+0045=" as token ids; the sum's digits least significant first, then END."""
    def padded(n: int) -> list[int]:
        return [int(c) for c in f"{n:0{DIGITS}d}"]

    return padded(a) + [PLUS] + padded(b) + [EQUALS], [int(c) for c in reversed(str(a + b))] + [END]


def collate(batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), (N, longest - 1) each: inputs padded with PAD, targets shifted by one with IGNORE on the prompt and the padding."""
    inputs = pad_sequence([s[:-1] for s in batch], batch_first=True, padding_value=PAD)
    targets = pad_sequence([s[1:] for s in batch], batch_first=True, padding_value=IGNORE)
    targets[:, :PROMPT_LEN - 1] = IGNORE
    return inputs, targets


class Block(nn.Module):
    """A pre-norm transformer block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads, self.dropout = n_heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = (z.view(n, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in self.qkv(self.norm1(x)).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(n, t, d)))
        return x + self.drop(self.mlp(self.norm2(x)))


class TinyGPT(nn.Module):
    """The course's decoder-only transformer: (N, T) token ids -> (N, T, vocab_size) logits."""

    def __init__(self, vocab_size: int, max_len: int, d_model: int, n_heads: int, n_layers: int, dropout: float = 0.0):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab_size, d_model), nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _layer in range(n_layers))
        self.norm, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tokens.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def greedy(model: Callable, prompts: torch.Tensor, max_new_tokens: int) -> list[list[int]]:
    """The course's greedy decoding, one forward per new token for the whole batch: each row's tokens before END."""
    tokens, answers, done = prompts, [[] for _row in range(len(prompts))], torch.zeros(len(prompts), dtype=torch.bool)
    with torch.inference_mode():
        for _step in range(max_new_tokens):
            nxt = torch.as_tensor(model(tokens))[:, -1].argmax(-1)
            for i in (~done).nonzero().flatten().tolist():
                if nxt[i] != END:
                    answers[i].append(int(nxt[i]))
            done |= nxt == END
            if done.all():
                break
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
    return answers


def prompts_of(problems: list[tuple[int, int]]) -> torch.Tensor:
    """The prompts of problems as one (N, PROMPT_LEN) tensor."""
    return torch.tensor([encode(a, b)[0] for a, b in problems])


def answer_tokens(a: int, b: int) -> list[int]:
    """The right answer's tokens without END."""
    return encode(a, b)[1][:-1]


def accuracy_by_carries(answers: list[list[int]], problems: list[tuple[int, int]]) -> dict[int, float]:
    """{carries: fraction of those problems answered exactly}, for the carry counts present."""
    right: dict[int, list[bool]] = {}
    for (a, b), got in zip(problems, answers):
        right.setdefault(addition.carries(a, b), []).append(list(got) == answer_tokens(a, b))
    return {c: sum(v) / len(v) for c, v in sorted(right.items())}


class OracleAdder(nn.Module):
    """A stand-in for a trained model that keeps the model's contract ((N, T) ids -> (N, T, VOCAB_SIZE) logits, causal):
    after a well-formed prompt and the right answer so far, it predicts the next answer token (END at the end); after
    anything else, PAD. Every call is recorded: its input's shape and whether inference mode was on."""

    def __init__(self, never_ends: bool = False):
        super().__init__()
        self.never_ends = never_ends
        self.calls: list[dict] = []

    def next_token(self, row: list[int]) -> int:
        if len(row) < PROMPT_LEN or row[DIGITS] != PLUS or row[PROMPT_LEN - 1] != EQUALS:
            return PAD
        a = int("".join(map(str, row[:DIGITS]))) if all(t < 10 for t in row[:DIGITS]) else None
        b = int("".join(map(str, row[DIGITS + 1:PROMPT_LEN - 1]))) if all(t < 10 for t in row[DIGITS + 1:PROMPT_LEN - 1]) else None
        if a is None or b is None:
            return PAD
        answer = [7] * 99 if self.never_ends else encode(a, b)[1]
        so_far = row[PROMPT_LEN:]
        if so_far != answer[:len(so_far)] or len(so_far) >= len(answer):
            return PAD
        return answer[len(so_far)]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls.append({"shape": tuple(tokens.shape), "inference": torch.is_inference_mode_enabled(),
                           "grad": torch.is_grad_enabled(), "dtype": tokens.dtype})
        rows = tokens.tolist()
        logits = torch.zeros(len(rows), tokens.shape[1], VOCAB_SIZE)
        for i, row in enumerate(rows):
            for t in range(len(row)):
                logits[i, t, self.next_token(row[:t + 1])] = 10.0
        return logits


class CountingModel(nn.Module):
    """Wraps a model to record the shape of every call (the batch a forward sees), and whether inference mode was on."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.calls: list[dict] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls.append({"shape": tuple(tokens.shape), "inference": torch.is_inference_mode_enabled(),
                           "grad": torch.is_grad_enabled(), "dtype": tokens.dtype})
        return self.model(tokens)


def _spread(model: nn.Module, seed: int, std: float = 0.3) -> nn.Module:
    """Redraw a model's weights with a larger spread, so that its greedy choices are clear-cut (no near-ties to flip)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


# Loading a learner's file.

def _expect_file(path, name: str) -> Path:
    if path is None:
        raise ExerciseFailed(_("expected the path of your {name}.py, got None: run the cell that sets it").format(name=name))
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
        raise ExerciseFailed(_("expected the path of your {name}.py (a str or pathlib.Path), got {got}").format(
            name=name, got=a_type(path)))
    file = Path(path)
    if file.stem != name:
        raise ExerciseFailed(_("expected the path of your {name}.py, got one of {file}").format(name=name, file=file.name))
    if not file.is_file():
        raise ExerciseFailed(_("{file} does not exist: run its %%writefile cell above").format(file=file.name))
    return file.resolve()


def _imports_the_course_reference(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
        if any(re.search(r"(^|\.)lesson11$", n) for n in names):
            return True
    return False


def _learner_module(path, name: str):
    """The learner's file `name`.py imported afresh, with the files beside it; one line for whatever goes wrong."""
    file = _expect_file(path, name)
    text = file.read_text(encoding="utf-8", errors="replace")
    try:
        tree = ast.parse(text)
    except SyntaxError as err:
        raise ExerciseFailed(_("{file} does not parse: SyntaxError at line {line}: {message}").format(
            file=file.name, line=err.lineno, message=err.msg)) from None
    if _imports_the_course_reference(tree):
        raise ExerciseFailed(_("{file} imports course_utils.lesson11, the course's references and checks: write your "
                               "own").format(file=file.name))
    saved = list(sys.path)
    try:
        return load(file)
    except NotImplementedError:
        raise  # an untouched stub at import time
    except Exception as err:  # noqa: BLE001 -- the learner's file
        line = next((tb.tb_lineno for tb in _traceback(err) if Path(tb.tb_frame.f_code.co_filename).resolve() == file), None)
        at = _(" (line {line})").format(line=line) if line else ""
        raise ExerciseFailed(_("importing {file} raised {error}: {message}{at}").format(
            file=file.name, error=type(err).__name__, message=first_line(err), at=at)) from None
    finally:
        sys.path[:] = saved


def _traceback(err: BaseException) -> Iterator:
    tb = err.__traceback__
    while tb is not None:
        yield tb
        tb = tb.tb_next


@contextlib.contextmanager
def _stubs(name: str, folder: Path) -> Iterator[None]:
    """An untouched stub in this exercise's file is 'not attempted'; one in an earlier file says which."""
    try:
        yield
    except NotImplementedError as err:
        stub = stub_frame(err)
        if stub is None or Path(stub[1]).resolve().parent != folder:
            raise
        if Path(stub[1]).stem == name:
            raise ExerciseNotAttempted(not_attempted_message(name)) from None
        raise ExerciseNotAttempted(_("not attempted yet: your code reaches the `raise NotImplementedError()` stub of "
                                     "{function} in {file}, an exercise before this one").format(
                                         function=stub[0], file=Path(stub[1]).name)) from None


def _learner_call(fn: Callable, *args, what: str) -> object:
    """Call the learner's function; its exception becomes one line that names the call (stubs pass through)."""
    try:
        return fn(*args)
    except NotImplementedError as err:
        if stub_frame(err) is not None:
            raise
        raise ExerciseFailed(_("{what} raised NotImplementedError: {message}{where}").format(
            what=what, message=_line(err), where=_where_in_learner(err))) from None
    except (ExerciseFailed, KeyboardInterrupt, SystemExit):
        raise
    except Exception as err:  # noqa: BLE001 -- the learner's error
        raise ExerciseFailed(_("{what} raised {error}: {message}{where}").format(
            what=what, error=type(err).__name__, message=_line(err), where=_where_in_learner(err))) from None


def _line(err: BaseException) -> str:
    """The first line of an error's message, without terminal colour codes (the ONNX exporter's have them)."""
    return re.sub(r"\x1b\[[0-9;]*m", "", first_line(err))


def _where_in_learner(err: BaseException) -> str:
    found = None
    for tb in _traceback(err):
        name = tb.tb_frame.f_code.co_filename
        if Path(name).stem in FILES:
            found = (Path(name).name, tb.tb_lineno)
    return _(" ({file}, line {line})").format(file=found[0], line=found[1]) if found else ""


def _show(tokens) -> str:
    return repr(addition.text(tokens))


# Exercise 1: capstone_data

DATA_PROBLEMS = [(0, 0), (9999, 9999), (5, 1234), (1000, 9000), (73, 8), (406, 5994), (1, 9999), (8, 1), (58, 4077)]


def _token_list(value, what: str) -> list[int]:
    if isinstance(value, torch.Tensor):
        raise ExerciseFailed(_("{what} is a tensor: return a list of Python ints").format(what=what))
    if not isinstance(value, (list, tuple)):
        raise ExerciseFailed(_("{what} is {got}, expected a list of token ids").format(what=what, got=a_type(value)))
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        odd = next(t for t in value if not isinstance(t, int) or isinstance(t, bool))
        raise ExerciseFailed(_("{what} holds {got}, expected Python ints").format(what=what, got=a_type(odd)))
    return list(value)


def _check_encode(module) -> None:
    encode_fn = getattr(module, "encode", None)
    if not callable(encode_fn):
        raise ExerciseFailed(_("capstone_data.py has no function encode(a, b)"))
    for a, b in DATA_PROBLEMS:
        what = f"encode({a}, {b})"
        got = _learner_call(encode_fn, a, b, what=what)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise ExerciseFailed(_("{what} returned {got}, expected a pair (prompt, answer)").format(what=what, got=a_type(got)))
        prompt = _token_list(got[0], _("{what}'s prompt").format(what=what))
        answer = _token_list(got[1], _("{what}'s answer").format(what=what))
        want_prompt, want_answer = encode(a, b)
        if prompt != want_prompt:
            plain = [int(c) for c in str(a)] + [PLUS] + [int(c) for c in str(b)] + [EQUALS]
            hint = _(": write each number with {digits} digits, leading zeros included").format(digits=DIGITS) if prompt == plain else ""
            raise ExerciseFailed(_("{what}: the prompt is {got}, expected {expected}{hint}").format(
                what=what, got=_show(prompt), expected=_show(want_prompt), hint=hint))
        if answer != want_answer:
            digits = [int(c) for c in str(a + b)]
            if answer == digits + [END]:
                hint = _(": the sum's digits go least significant first")
            elif answer == want_answer[:-1]:
                hint = _(": end the answer with END ({end})").format(end=END)
            elif len(answer) == MAX_ANSWER and answer[:len(want_answer) - 1] == want_answer[:-1]:
                hint = _(": write the sum's own digits, without padding it to a fixed length")
            else:
                hint = ""
            raise ExerciseFailed(_("{what}: the answer is {got}, expected {expected}{hint}").format(
                what=what, got=_show(answer), expected=_show(want_answer), hint=hint))


def _check_dataset(module) -> list[torch.Tensor]:
    cls = getattr(module, "AdditionDataset", None)
    if cls is None:
        raise ExerciseFailed(_("capstone_data.py has no class AdditionDataset"))
    problems = [(12, 3456), (9999, 1), (0, 7), (4321, 5678), (505, 505)]
    given = list(problems)
    dataset = _learner_call(cls, given, what="AdditionDataset(problems)")
    if given != problems:
        raise ExerciseFailed(_("AdditionDataset(problems) changed the list of problems it was given"))
    n = _learner_call(len, dataset, what="len(AdditionDataset(problems))")
    if n != len(problems):
        raise ExerciseFailed(_("len(AdditionDataset(5 problems)) is {n!r}, expected 5").format(n=n))
    items = []
    for i, (a, b) in enumerate(problems):
        item = _learner_call(dataset.__getitem__, i, what=f"dataset[{i}]")
        want = torch.tensor(sum(encode(a, b), []))
        if not isinstance(item, torch.Tensor):
            raise ExerciseFailed(_("dataset[{i}] is {got}, expected a 1-D int64 tensor of the prompt's and the answer's "
                                   "tokens").format(i=i, got=a_type(item)))
        if item.dtype != torch.int64 or item.ndim != 1:
            raise ExerciseFailed(_("dataset[{i}] is a {ndim}-D {dtype} tensor, expected a 1-D int64 tensor").format(
                i=i, ndim=item.ndim, dtype=item.dtype))
        if not torch.equal(item, want):
            raise ExerciseFailed(_("dataset[{i}] for {a}+{b} holds {got}, expected the prompt then the answer: {expected}").format(
                i=i, a=a, b=b, got=_show(item), expected=_show(want)))
        items.append(item)
    return items


def _check_collate(module) -> None:
    collate_fn = getattr(module, "collate", None)
    if not callable(collate_fn):
        raise ExerciseFailed(_("capstone_data.py has no function collate(batch)"))
    problems = [(3, 4), (999, 999), (406, 5994), (0, 0), (12, 34)]  # the longest is shorter than the longest possible
    batch = [torch.tensor(sum(encode(a, b), [])) for a, b in problems]
    before = [s.clone() for s in batch]
    got = _learner_call(collate_fn, batch, what=_("collate(a batch of 5 sequences)"))
    if any(not torch.equal(a, b) for a, b in zip(before, batch)) or len(batch) != 5:
        raise ExerciseFailed(_("collate changed the sequences it was given: build new tensors"))
    if not isinstance(got, (tuple, list)) or len(got) != 2 or not all(isinstance(t, torch.Tensor) for t in got):
        raise ExerciseFailed(_("collate returned {got}, expected a pair of tensors (inputs, targets)").format(got=a_type(got)))
    inputs, targets = got
    want_inputs, want_targets = collate(batch)
    for what, tensor, want in (("inputs", inputs, want_inputs), ("targets", targets, want_targets)):
        if tensor.dtype != torch.int64:
            raise ExerciseFailed(_("collate's {what} are {dtype}, expected int64 token ids").format(what=what, dtype=tensor.dtype))
        if tuple(tensor.shape) != tuple(want.shape):
            longest = max(len(s) for s in batch)
            hint = (_(": pad to the longest sequence of the batch ({longest} tokens), minus the last token").format(longest=longest)
                    if tensor.ndim == 2 and tensor.shape[0] == len(batch) else "")
            raise ExerciseFailed(_("collate's {what} have shape {shape}, expected {expected}{hint}").format(
                what=what, shape=tuple(tensor.shape), expected=tuple(want.shape), hint=hint))
    if not torch.equal(inputs, want_inputs):
        if torch.equal(inputs.masked_fill(want_inputs == PAD, PAD), want_inputs):
            ends = [inputs[i, len(s) - 1].item() == END for i, s in enumerate(batch) if len(s) - 1 < inputs.shape[1]]
            if ends and all(ends):
                raise ExerciseFailed(_("collate's inputs hold each shorter sequence's END ({end}) where its padding begins: drop "
                                       "every sequence's last token, then pad with PAD").format(end=END))
            pad = inputs[want_inputs == PAD][0].item()
            if pad == 0:
                raise ExerciseFailed(_("collate pads the inputs with {got}, the digit zero: pad them with PAD ({pad})").format(
                    got=pad, pad=PAD))
            raise ExerciseFailed(_("collate pads the inputs with {got}: pad them with PAD ({pad})").format(got=pad, pad=PAD))
        row = next(i for i in range(len(batch)) if not torch.equal(inputs[i], want_inputs[i]))
        raise ExerciseFailed(_("collate's inputs for sequence {row} are {got}, expected {expected}: each sequence without its "
                               "last token, then padding").format(row=row, got=_show(inputs[row]), expected=_show(want_inputs[row])))
    if torch.equal(targets, want_targets):
        return
    real = want_targets != IGNORE
    if not torch.equal(targets[real], want_targets[real]):
        if (targets[:, PROMPT_LEN - 1] == IGNORE).all():
            raise ExerciseFailed(_("collate's targets ignore position {position}, whose target is the answer's first digit: "
                                   "only positions 0 to {last} predict prompt tokens").format(
                                       position=PROMPT_LEN - 1, last=PROMPT_LEN - 2))
        if torch.equal(targets[real], want_inputs[real]):
            raise ExerciseFailed(_("collate's targets are the inputs themselves: the target at each position is the token after it"))
        row = next(i for i in range(len(batch)) if not torch.equal(targets[i][real[i]], want_targets[i][real[i]]))
        raise ExerciseFailed(_("collate's targets for sequence {row} ({a}+{b}) are {got}, expected {expected}").format(
            row=row, a=problems[row][0], b=problems[row][1], got=targets[row].tolist(), expected=want_targets[row].tolist()))
    padding = (want_inputs == PAD) & (targets != IGNORE)
    if padding.any():
        raise ExerciseFailed(_("collate's targets hold {got} at padded positions: put IGNORE ({ignore}) there, or the loss counts "
                               "the padding").format(got=targets[padding][0].item(), ignore=IGNORE))
    raise ExerciseFailed(_("collate's targets at the prompt's positions (0 to {last}) are not IGNORE ({ignore}): put IGNORE "
                           "there, since the prompt is given, not predicted").format(last=PROMPT_LEN - 2, ignore=IGNORE))


@exercise("capstone_data")
def check_capstone_data(path) -> None:
    file = _expect_file(path, "capstone_data")
    with _stubs("capstone_data", file.parent):
        module = _learner_module(file, "capstone_data")
        _check_encode(module)
        _check_dataset(module)
        _check_collate(module)
        dataset = _learner_call(module.AdditionDataset, addition.problems(7, 5), what=_("AdditionDataset(7 problems)"))
        loader = torch.utils.data.DataLoader(dataset, batch_size=3, collate_fn=module.collate)
        batches = _learner_call(list, loader, what=_("a DataLoader of your dataset and collate"))
        sizes = [tuple(inputs.shape) for inputs, _targets in batches]
        if [s[0] for s in sizes] != [3, 3, 1]:
            raise ExerciseFailed(_("a DataLoader(batch_size=3) over 7 problems gave batches of {sizes}, expected [3, 3, 1]").format(
                sizes=[s[0] for s in sizes]))


# Exercise 2: capstone_model

LESSON_SIZES = {"d_model": 64, "n_heads": 4, "n_layers": 2}
PARAMETER_BUDGET = 110_000   # the course's model has 101,952 at LESSON_SIZES (102,848 without weight tying)
MODEL_SIZES = [{"d_model": 24, "n_heads": 3, "n_layers": 2}, {"d_model": 32, "n_heads": 4, "n_layers": 1}]


def _sizes(sizes: dict, dropout: float) -> str:
    return ", ".join(f"{k}={v}" for k, v in {**sizes, "dropout": dropout}.items())


def _build(cls, sizes: dict, dropout: float = 0.0) -> nn.Module:
    what = f"TinyGPT({_sizes(sizes, dropout)})"
    model = _learner_call(lambda: cls(vocab_size=VOCAB_SIZE, max_len=MAX_LEN, dropout=dropout, **sizes), what=what)
    if not isinstance(model, nn.Module):
        raise ExerciseFailed(_("{what} made {got}, expected a torch.nn.Module").format(what=what, got=a_type(model)))
    return model


def _forward(model: nn.Module, tokens: torch.Tensor, what: str) -> torch.Tensor:
    before = tokens.clone()
    out = _learner_call(model, tokens, what=what)
    if not torch.equal(before, tokens):
        raise ExerciseFailed(_("{what} changed the tokens it was given").format(what=what))
    if not isinstance(out, torch.Tensor):
        raise ExerciseFailed(_("{what} returned {got}, expected a tensor of logits").format(what=what, got=a_type(out)))
    n, t = tokens.shape
    if tuple(out.shape) != (n, t, VOCAB_SIZE):
        why = (_(": does it add all {max_len} position vectors instead of the first {t}?").format(max_len=MAX_LEN, t=t)
               if tuple(out.shape) == (n, MAX_LEN, VOCAB_SIZE) and t < MAX_LEN else
               _(": a score for every token of the vocabulary at every position"))
        raise ExerciseFailed(_("{what} returned shape {shape}, expected ({n}, {t}, {vocab_size}){why}").format(
            what=what, shape=tuple(out.shape), n=n, t=t, vocab_size=VOCAB_SIZE, why=why))
    return out


def _check_init(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) and module.weight.numel() >= 256:
            std = module.weight.detach().float().std().item()
            if not 0.015 < std < 0.025:
                kind = type(module).__name__
                raise ExerciseFailed(_("the {kind} {name!r} starts with weights of standard deviation {std:.3f}: initialise every "
                                       "Linear and Embedding weight from a normal distribution of std 0.02").format(
                                           kind=kind, name=name, std=std))
        if isinstance(module, nn.Linear) and module.bias is not None and module.bias.detach().abs().max() > 0:
            raise ExerciseFailed(_("the Linear {name!r} starts with a nonzero bias: initialise the biases to zero").format(name=name))


def _check_causal(model: nn.Module, sizes: dict) -> None:
    g = torch.Generator().manual_seed(23)
    tokens = torch.randint(0, VOCAB_SIZE, (3, MAX_LEN), generator=g)
    what = _("{what} in eval mode").format(what=f"TinyGPT({_sizes(sizes, 0.0)})")
    base = _forward(model, tokens, what)
    if base.isnan().any():
        pos = int(base.isnan().any(-1).any(0).nonzero()[0])
        raise ExerciseFailed(_("{what} gives NaN at position {position}: does the mask hide every key of a position (its own "
                               "included)?").format(what=what, position=pos))
    for t in (1, 6, MAX_LEN - 1):
        changed = tokens.clone()
        changed[:, t:] = (changed[:, t:] + 1 + torch.randint(0, VOCAB_SIZE - 1, changed[:, t:].shape, generator=g)) % VOCAB_SIZE
        out = _forward(model, changed, what)
        moved = (out[:, :t] - base[:, :t]).abs().amax(dim=(0, 2))
        if (moved > 1e-5).any():
            first = int((moved > 1e-5).nonzero()[0])
            raise ExerciseFailed(_("model: changing the tokens from position {t} on changed the output at position {first}: it "
                                   "peeks at later tokens; position i may see tokens 0 to i only (a causal mask)").format(
                                       t=t, first=first))
        if not (out[:, t] - base[:, t]).abs().amax() > 1e-6:
            raise ExerciseFailed(_("model: changing the token at position {t} left the output at position {t} as it was: each "
                                   "position must see its own token").format(t=t))
    changed = tokens.clone()
    changed[:, 0] = (changed[:, 0] + 3) % VOCAB_SIZE
    out = _forward(model, changed, what)
    if not (out[:, 1:] - base[:, 1:]).abs().amax() > 1e-6:
        raise ExerciseFailed(_("model: changing the token at position 0 changed no later output: every position must attend to "
                               "the positions before it"))


@exercise("capstone_model")
def check_capstone_model(path) -> None:
    file = _expect_file(path, "capstone_model")
    with _stubs("capstone_model", file.parent):
        module = _learner_module(file, "capstone_model")
        cls = getattr(module, "TinyGPT", None)
        if cls is None:
            raise ExerciseFailed(_("capstone_model.py has no class TinyGPT"))
        torch.manual_seed(5)
        lesson = _build(cls, LESSON_SIZES)
        count = sum(p.numel() for p in lesson.parameters())
        if count > PARAMETER_BUDGET:
            raise ExerciseFailed(_("{what} has {count:,} parameters, over the budget of {budget:,}: one Linear(d, 3d) or three "
                                   "Linear(d, d) for q, k, v, a 4d-wide MLP").format(
                                       what=f"TinyGPT({_sizes(LESSON_SIZES, 0.0)})", count=count, budget=PARAMETER_BUDGET))
        _check_init(lesson)
        for sizes in MODEL_SIZES:
            model = _build(cls, sizes)
            reference = sum(p.numel() for p in TinyGPT(VOCAB_SIZE, MAX_LEN, **sizes).parameters()) + VOCAB_SIZE * sizes["d_model"]
            mine = sum(p.numel() for p in model.parameters())
            if mine > 1.1 * reference:
                raise ExerciseFailed(_("{what} has {count:,} parameters, more than the {reference:,} of such a model: build it "
                                       "from the sizes it is given").format(
                                           what=f"TinyGPT({_sizes(sizes, 0.0)})", count=mine, reference=reference))
            model.eval()
            for n, t in ((1, 1), (2, 2), (4, 7), (3, MAX_LEN)):
                tokens = torch.randint(0, VOCAB_SIZE, (n, t), generator=torch.Generator().manual_seed(n * 31 + t))
                out = _forward(model, tokens, _("{what} on tokens of shape ({n}, {t})").format(
                    what=f"TinyGPT({_sizes(sizes, 0.0)})", n=n, t=t))
                if out.dtype != torch.float32:
                    raise ExerciseFailed(_("TinyGPT's logits are {dtype}, expected float32 outside autocast").format(dtype=out.dtype))
            if model.training:
                raise ExerciseFailed(_("a forward pass switched the model to train mode: leave its mode alone"))
            _check_structure(model, sizes)
            _check_causal(model, sizes)
        _check_dropout(cls)
        _check_training_step(cls)


def _check_dropout(cls) -> None:
    sizes = MODEL_SIZES[0]
    model = _build(cls, sizes, dropout=0.5).train()
    tokens = torch.randint(0, VOCAB_SIZE, (2, 8), generator=torch.Generator().manual_seed(8))
    what = f"TinyGPT({_sizes(sizes, 0.5)})"
    training, evaluating = _("{what} in train mode").format(what=what), _("{what} in eval mode").format(what=what)
    first, second = _forward(model, tokens, training), _forward(model, tokens, training)
    if torch.equal(first, second):
        raise ExerciseFailed(_("{what} in train mode gave the same output twice: apply dropout with probability "
                               "`dropout`").format(what=what))
    model.eval()
    if not torch.equal(_forward(model, tokens, evaluating), _forward(model, tokens, evaluating)):
        raise ExerciseFailed(_("{what} in eval mode gave two different outputs for the same tokens: dropout must stop in eval "
                               "mode").format(what=what))


def _check_training_step(cls) -> None:
    sizes = MODEL_SIZES[1]
    model = _build(cls, sizes).train()
    inputs, targets = collate([torch.tensor(sum(encode(a, b), [])) for a, b in addition.problems(6, 9)])
    what = _("{what} under torch.autocast('cpu', dtype=torch.bfloat16)").format(what=f"TinyGPT({_sizes(sizes, 0.0)})")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = _forward(model, inputs, what)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    _learner_call(loss.backward, what=_("backward through {what}").format(what=what))
    missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if missing:
        raise ExerciseFailed(_("after a backward pass, parameter {name!r} has no gradient: DistributedDataParallel refuses "
                               "parameters that take no part in the loss").format(name=missing[0]))


# Exercise 4: capstone_decode

DECODE_PROBLEMS = [(0, 0), (9999, 9999), (15, 7), (4820, 5180), (3, 996), (1234, 4321), (9, 1)]


def _expect_answers(got, n: int, what: str) -> list[list[int]]:
    if not isinstance(got, (list, tuple)):
        raise ExerciseFailed(_("{what} returned {got}, expected a list of {n} lists of token ids").format(
            what=what, got=a_type(got), n=n))
    if len(got) != n:
        raise ExerciseFailed(_("{what} returned {answers} answers for {n} prompts").format(what=what, answers=len(got), n=n))
    return [_token_list(row, _("{what}'s answer {i}").format(what=what, i=i)) for i, row in enumerate(got)]


def _decode(generate: Callable, model: Callable, prompts: torch.Tensor, max_new: int, what: str) -> list[list[int]]:
    before = prompts.clone()
    got = _learner_call(generate, model, prompts, max_new, what=what)
    if not torch.equal(before, prompts):
        raise ExerciseFailed(_("{what} changed the prompts it was given: build new tensors").format(what=what))
    return _expect_answers(got, len(prompts), what)


def _check_calls(calls: list[dict], n: int, longest: int, what: str) -> None:
    if not calls:
        raise ExerciseFailed(_("{what} never called the model").format(what=what))
    if any(not c["inference"] for c in calls):
        raise ExerciseFailed(_("{what} ran the model outside torch.inference_mode(): decode under it, so that no graph is "
                               "recorded").format(what=what))
    if n > 1 and all(c["shape"][0] == 1 for c in calls):
        raise ExerciseFailed(_("{what} ran the model on one prompt at a time ({calls} calls of a batch of 1): run the whole "
                               "batch in each forward pass").format(what=what, calls=len(calls)))
    if len(calls) > longest + 1:
        raise ExerciseFailed(_("{what} called the model {calls} times, but every answer had ended after {needed}: one forward "
                               "pass per new token, and stop as soon as every row has produced END").format(
                                   what=what, calls=len(calls), needed=longest + 1))


class _PositionMarker(nn.Module):
    """A model whose argmax at position t is the digit t % 10: the first token generate returns names the position read."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*tokens.shape, VOCAB_SIZE)
        logits[:, torch.arange(tokens.shape[1]), torch.arange(tokens.shape[1]) % 10] = 1.0
        return logits


def _answer_fault(generate: Callable, row: list[int], want: list[int]) -> str:
    """Why a row differs from the oracle's answer, where the row proves it; else the expected answer alone."""
    if row == want + [END] or (row[:len(want) + 1] == want + [END] and set(row[len(want):]) == {END}):
        return _(": leave END out of the answers")
    if len(row) > len(want) and row[:len(want)] == want:
        return _(", expected {expected}: the row goes on after the model's END; a row's answer is the tokens before its "
                 "first END, and nothing after it").format(expected=_show(want))
    if 0 < len(row) < len(want) and want[:len(row)] == row:
        return _(", expected {expected}: it stopped before that row's END; go on until every row has produced END "
                 "(or max_new_tokens)").format(expected=_show(want))
    if len(row) == len(want) > 1 and row == want[::-1]:
        return _(": the digits are reversed; return them in the order the model generates them, least significant first")
    try:  # where the learner reads the logits: the marker's first token is the position's index mod 10
        with contextlib.redirect_stdout(None):
            read = generate(_PositionMarker(), prompts_of([(1, 2), (3, 4)]), 1)
        position = read[0][0]
    except Exception:  # noqa: BLE001 -- a diagnosis only; the verdict stands without it
        position = None
    if isinstance(position, int) and position != (PROMPT_LEN - 1) % 10:
        return _(", expected {expected}: generate took the argmax at position {position} of the {prompt_len} prompt tokens, "
                 "not the last; use the last position's logits, logits[:, -1]").format(
                     expected=_show(want), position=position, prompt_len=PROMPT_LEN)
    return _(", expected {expected}").format(expected=_show(want))


def _check_plain_function(generate: Callable) -> None:
    """The model may be a plain function (an ONNX Runtime session wrapped as one): generate must only call it."""
    oracle = OracleAdder()

    def model(tokens):
        return oracle(tokens)

    what = _("generate(a plain function as the model, 2 prompts, 6)")
    try:
        _decode(generate, model, prompts_of(DECODE_PROBLEMS[:2]), MAX_ANSWER, what)
    except ExerciseFailed as err:
        if "AttributeError" in err.message and "'function' object" in err.message:
            raise ExerciseFailed(_("{message}: `model` may be a function (an ONNX Runtime session wrapped as one), so only "
                                   "call it: no .eval(), .to() or .parameters()").format(message=err.message)) from None
        raise


@exercise("capstone_decode")
def check_capstone_decode(path) -> None:
    file = _expect_file(path, "capstone_decode")
    with _stubs("capstone_decode", file.parent):
        module = _learner_module(file, "capstone_decode")
        generate = getattr(module, "generate", None)
        if not callable(generate):
            raise ExerciseFailed(_("capstone_decode.py has no function generate(model, prompts, max_new_tokens)"))
        prompts = prompts_of(DECODE_PROBLEMS)
        oracle = OracleAdder()
        max_new = MAX_ANSWER + 2  # more than any answer needs: the loop must stop when every row has ended
        what = _("generate(a model that adds, {n} prompts, {max_new})").format(n=len(prompts), max_new=max_new)
        got = _decode(generate, oracle, prompts, max_new, what)
        if any(c["shape"][1] < PROMPT_LEN for c in oracle.calls):
            raise ExerciseFailed(_("{what} ran the model on fewer tokens than the prompt: feed it the prompt and the answer so "
                                   "far").format(what=what))
        for (a, b), row in zip(DECODE_PROBLEMS, got):
            want = answer_tokens(a, b)
            if row != want:
                raise ExerciseFailed(_("{what}: the answer to {a}+{b} is {got}{fault}").format(
                    what=what, a=a, b=b, got=_show(row), fault=_answer_fault(generate, row, want)))
        _check_calls(oracle.calls, len(prompts), max(len(answer_tokens(a, b)) for a, b in DECODE_PROBLEMS), what)
        _check_plain_function(generate)

        one = prompts_of([(55, 45)])
        endless = OracleAdder(never_ends=True)
        got = _decode(generate, endless, one, 3, _("generate(a model that never says END, 1 prompt, 3)"))
        if got != [[7, 7, 7]]:
            raise ExerciseFailed(_("generate(a model that never says END, 1 prompt, max_new_tokens=3) returned {got}, expected "
                                   "[[7, 7, 7]]: stop after max_new_tokens tokens").format(got=got))

        torch.manual_seed(0)
        reference = _spread(TinyGPT(VOCAB_SIZE, MAX_LEN, 24, 3, 2), seed=41).eval()
        problems = addition.problems(9, seed=404)
        prompts = prompts_of(problems)
        counted = CountingModel(reference)
        what = _("generate(a TinyGPT with random weights, 9 prompts, 6)")
        got = _decode(generate, counted, prompts, MAX_ANSWER, what)
        want = greedy(reference, prompts, MAX_ANSWER)
        for i, (row, expected) in enumerate(zip(got, want)):
            if row != expected:
                raise ExerciseFailed(_("{what}: prompt {i} got {got}, greedy decoding gives {expected}: at each step take the "
                                       "argmax of the last position's logits and append it").format(
                                           what=what, i=i, got=_show(row), expected=_show(expected)))
        if any(c["shape"][0] == 1 for c in counted.calls) and len(counted.calls) > MAX_ANSWER:
            raise ExerciseFailed(_("{what} ran the model on one prompt at a time: run the whole batch in each forward "
                                   "pass").format(what=what))


# Exercise 5: capstone_ship

SHIP_SIZES = {"d_model": 32, "n_heads": 4, "n_layers": 2}
SHIP_SHAPES = [(1, 1), (2, 2), (5, PROMPT_LEN), (3, MAX_LEN), (1, MAX_LEN)]
SHIP_MAX_BATCH = 1024   # the largest batch the exported program must take
SERVE_SPEEDUP = 3.0   # how much faster serve must answer 48 requests than one request at a time


class _DigitsThenEnd(nn.Module):
    """A real model's forward, its choices kept to digits for the first four answer tokens, then END: a model's cost,
    and answers a server can print."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens).clone()
        answer_position = torch.arange(tokens.shape[1]) - (PROMPT_LEN - 1)
        logits[..., 10:] = -1e4
        logits[:, answer_position >= DIGITS, END] = 1e4
        return logits


def _ship_model() -> nn.Module:
    torch.manual_seed(0)
    return _spread(TinyGPT(VOCAB_SIZE, MAX_LEN, dropout=0.2, **SHIP_SIZES), seed=77)


def _shape_fault(what: str, n: int, t: int, err: BaseException) -> str:
    """what: 'your exported program' or 'your ONNX file', in the learner's language."""
    return _("ship: {what} refuses tokens of shape ({n}, {t}) ({error}: {message}): make the batch (1 to 1024) and the length "
             "(1 to {max_len}) dynamic, and export from an example of 2 or more in each").format(
                 what=what, n=n, t=t, error=type(err).__name__, message=first_line(err)[:120], max_len=MAX_LEN)


def _check_program(program, eager: nn.Module) -> None:
    from torch.export import ExportedProgram

    if not isinstance(program, ExportedProgram):
        raise ExerciseFailed(_("export_program returned {got}, expected the ExportedProgram of torch.export.export").format(
            got=a_type(program)))
    run = program.module()
    g = torch.Generator().manual_seed(13)
    for n, t in SHIP_SHAPES:
        tokens = torch.randint(0, VOCAB_SIZE, (n, t), generator=g)
        try:
            with torch.inference_mode():
                got = run(tokens)
        except Exception as err:  # noqa: BLE001 -- the exported program's guards refuse the shape
            raise ExerciseFailed(_shape_fault(_("your exported program"), n, t, err)) from None
        with torch.inference_mode():
            want = eager(tokens)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            raise ExerciseFailed(_("ship: your exported program returned {got} for tokens of shape ({n}, {t}), expected logits "
                                   "of shape {shape}").format(got=a_type(got), n=n, t=t, shape=tuple(want.shape)))
        if not torch.allclose(got, want, atol=1e-4, rtol=1e-4):
            dropout = any("dropout" in str(node.target) for node in program.graph.nodes if node.op == "call_function")
            if dropout:
                raise ExerciseFailed(_("ship: your exported program has dropout in its graph: the model was in train mode; call "
                                       "model.eval() before torch.export.export"))
            raise ExerciseFailed(_("ship: your exported program's logits for tokens of shape ({n}, {t}) differ from the "
                                   "eval-mode model's by up to {difference:.2g}").format(
                                       n=n, t=t, difference=(got - want).abs().max()))
    tokens = torch.randint(0, VOCAB_SIZE, (SHIP_MAX_BATCH, 2), generator=g)   # short: the batch's bound is what is tested
    try:
        with torch.inference_mode():
            run(tokens)
    except Exception as err:  # noqa: BLE001 -- the exported program's guards refuse the shape
        raise ExerciseFailed(_shape_fault(_("your exported program"), SHIP_MAX_BATCH, 2, err)) from None


@contextlib.contextmanager
def _counting_onnx_runs() -> Iterator[list[int]]:
    """Count the calls of onnxruntime.InferenceSession.run while inside."""
    import onnxruntime as ort

    calls: list[int] = []
    real = ort.InferenceSession.run

    def run(session, *args, **kwargs):
        calls.append(1)
        return real(session, *args, **kwargs)

    ort.InferenceSession.run = run
    try:
        yield calls
    finally:
        ort.InferenceSession.run = real


@contextlib.contextmanager
def _watching_onnx_exports() -> Iterator[list[dict]]:
    """Record the keyword arguments of every torch.onnx.export call while inside."""
    calls: list[dict] = []
    real = torch.onnx.export

    @functools.wraps(real)
    def export(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    torch.onnx.export = export
    try:
        yield calls
    finally:
        torch.onnx.export = real


def _check_onnx(export_onnx: Callable, eager: nn.Module, folder: Path) -> None:
    import onnxruntime as ort

    path = folder / "adder.onnx"
    problems = addition.problems(6, seed=606)
    prompts = prompts_of(problems)
    what = _("export_onnx(model, path, 6 prompts)")
    eager.train()
    with _counting_onnx_runs() as runs, _watching_onnx_exports() as exports:
        try:
            got = _learner_call(export_onnx, eager, path, prompts.clone(), what=what)
        except ExerciseFailed:
            if not any(call.get("dynamo") is False for call in exports):
                raise
    if any(call.get("dynamo") is False for call in exports):   # named first: its deprecation warning may have raised
        raise ExerciseFailed(_("ship: {what} called torch.onnx.export(..., dynamo=False), the TorchScript exporter: use the "
                               "dynamo exporter (dynamo=True, the default)").format(what=what))
    if not path.exists():
        raise ExerciseFailed(_("ship: {what} wrote no file at `path`").format(what=what))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    try:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as err:  # noqa: BLE001 -- the learner's file
        raise ExerciseFailed(_("ship: ONNX Runtime cannot open the file export_onnx wrote ({error}: {message})").format(
            error=type(err).__name__, message=first_line(err)[:100])) from None
    inputs, outputs = [i.name for i in session.get_inputs()], [o.name for o in session.get_outputs()]
    if inputs != ["tokens"] or outputs[:1] != ["logits"]:
        raise ExerciseFailed(_("ship: the ONNX file's inputs are {inputs} and outputs {outputs}, expected ['tokens'] and "
                               "['logits']").format(inputs=inputs, outputs=outputs))
    eager.eval()
    g = torch.Generator().manual_seed(17)
    for n, t in SHIP_SHAPES:
        tokens = torch.randint(0, VOCAB_SIZE, (n, t), generator=g)
        try:
            (logits,) = session.run(["logits"], {"tokens": tokens.numpy()})
        except Exception as err:  # noqa: BLE001 -- ONNX Runtime refuses the shape
            raise ExerciseFailed(_shape_fault(_("your ONNX file"), n, t, err)) from None
        with torch.inference_mode():
            want = eager(tokens)
        if tuple(logits.shape) != tuple(want.shape) or not torch.allclose(torch.from_numpy(logits), want, atol=1e-4, rtol=1e-4):
            raise ExerciseFailed(_("ship: ONNX Runtime's logits for tokens of shape ({n}, {t}) differ from the eval-mode "
                                   "model's").format(n=n, t=t))
    want = greedy(eager, prompts, MAX_ANSWER)
    onnx_tokens = greedy(lambda x: torch.from_numpy(session.run(["logits"], {"tokens": x.numpy()})[0]), prompts, MAX_ANSWER)
    if onnx_tokens != want:
        raise ExerciseFailed(_("ship: greedy decoding with ONNX Runtime gives other tokens than the eager model"))
    got = _expect_answers(got, len(prompts), what)
    if not runs:
        raise ExerciseFailed(_("ship: {what} never ran ONNX Runtime: decode the prompts with a session of the file you "
                               "wrote").format(what=what))
    if got != want:
        i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        raise ExerciseFailed(_("ship: {what} returned {got} for prompt {i}, but greedy decoding of that file gives "
                               "{expected}").format(what=what, got=_show(got[i]), i=i, expected=_show(want[i])))


def _check_serve(serve: Callable) -> None:
    requests = ["7+5", "0+0", "9999+9999", "1234+8766", "45+6", "300+700", "5+4", "808+2", "9+991", "6789+1", "12+12"]
    given = list(requests)
    oracle = OracleAdder()
    what = _("serve(a model that adds, 11 requests, max_batch=4)")
    got = _learner_call(serve, oracle, given, 4, what=what)
    if given != requests:
        raise ExerciseFailed(_("serve: {what} changed the list of requests").format(what=what))
    if not isinstance(got, (list, tuple)) or len(got) != len(requests):
        raise ExerciseFailed(_("serve: {what} returned {got}, expected a list of 11 answers").format(what=what, got=a_type(got)))
    sums = [str(sum(map(int, request.split("+")))) for request in requests]
    for request, answer, want in zip(requests, got, sums):
        if not isinstance(answer, str):
            raise ExerciseFailed(_("serve: the answer to {request!r} is {got}, expected a str such as {expected!r}").format(
                request=request, got=a_type(answer), expected=want))
        if answer != want:
            if sorted(got) == sorted(sums):
                raise ExerciseFailed(_("serve: {what} returned the right sums in another order (the answer to {request!r} is "
                                       "{answer!r}, expected {expected!r}): answer in the order of the requests").format(
                                           what=what, request=request, answer=answer, expected=want))
            if answer == want[::-1]:
                raise ExerciseFailed(_("serve: the answer to {request!r} is {answer!r}, expected {expected!r}: the model writes "
                                       "the digits least significant first; reverse them").format(
                                           request=request, answer=answer, expected=want))
            raise ExerciseFailed(_("serve: the answer to {request!r} is {answer!r}, expected {expected!r}").format(
                request=request, answer=answer, expected=want))
    sizes = [c["shape"][0] for c in oracle.calls]
    if any(c["shape"][0] > 4 for c in oracle.calls):
        raise ExerciseFailed(_("serve: {what} ran a forward pass on {n} requests: at most max_batch at once").format(
            what=what, n=max(sizes)))
    if all(s == 1 for s in sizes):
        raise ExerciseFailed(_("serve: {what} ran the model on one request at a time ({calls} calls of a batch of 1): answer "
                               "the requests in batches of up to max_batch").format(what=what, calls=len(sizes)))
    if any(not c["inference"] for c in oracle.calls):
        raise ExerciseFailed(_("serve: {what} ran the model outside torch.inference_mode()").format(what=what))
    model = _DigitsThenEnd(_ship_model().eval())
    requests = [f"{a}+{b}" for a, b in addition.problems(48, seed=808)]
    batched, single = [], []
    for _attempt in range(2):
        start = time.perf_counter()
        _learner_call(serve, model, requests, 48, what=_("serve(model, 48 requests, max_batch=48)"))
        batched.append(time.perf_counter() - start)
        start = time.perf_counter()
        for request in requests:
            greedy(model, prompts_of([tuple(map(int, request.split("+")))]), MAX_ANSWER)
        single.append(time.perf_counter() - start)
    speedup = min(single) / min(batched)
    if speedup < SERVE_SPEEDUP:
        raise ExerciseFailed(_("serve: answering 48 requests took {batched_ms:.0f} ms, only {speedup:.1f}x faster than one "
                               "request at a time ({single_ms:.0f} ms); at least {needed:g}x is expected").format(
                                   batched_ms=min(batched) * 1e3, speedup=speedup, single_ms=min(single) * 1e3,
                                   needed=SERVE_SPEEDUP))


@exercise("capstone_ship")
def check_capstone_ship(path) -> None:
    file = _expect_file(path, "capstone_ship")
    with _stubs("capstone_ship", file.parent), tempfile.TemporaryDirectory(prefix="lesson11-ship-") as folder:
        module = _learner_module(file, "capstone_ship")
        for name in ("export_program", "export_onnx", "serve"):
            if not callable(getattr(module, name, None)):
                raise ExerciseFailed(_("capstone_ship.py has no function {name}").format(name=name))
        _check_serve(module.serve)  # first: it costs no export
        eager = _ship_model().train()  # as it comes out of training: export_program must switch it to eval mode
        try:
            program = _learner_call(module.export_program, eager, what="export_program(model)")
        except ExerciseFailed as err:
            if "Constraints violated" in err.message:   # a size of 1 in the example: torch.export specialises 0 and 1
                raise ExerciseFailed(_("{message}: export from an example of 2 or more in each dynamic dimension; "
                                       "torch.export treats a size of 1 as a constant").format(message=err.message)) from None
            raise
        _check_program(program, eager.eval())
        _check_onnx(module.export_onnx, eager, Path(folder))


# Exercise 3: capstone_train, run on two real ranks and judged by what each one did.

TRAIN_STEPS, TRAIN_EVERY, TRAIN_KILL_AT, TRAIN_BATCH, TRAIN_WARMUP = 12, 4, 10, 4, 3
TRAIN_LR, TRAIN_DECAY, TRAIN_CLIP, TRAIN_SEED = 0.02, 0.05, 0.05, 7
COMMON_SEEDS = (0, 1, 42, 1234, 1337)   # seeds a script may hard-code in place of --seed
TRAIN_MODEL = {"--d-model": "16", "--heads": "2", "--layers": "1"}
ACCURACY_PER_CARRY = 0.9      # the trained model must answer this share of the hidden problems of every carry count
ACCURACY_PROBLEMS = 60        # hidden problems per carry count
SCALE_TOLERANCE = 1e-4        # relative difference of the gradients, one step on 2 ranks vs one process, in float32


def _args(**values) -> list[str]:
    out = []
    for key, value in values.items():
        out += [f"--{key.replace('_', '-')}", str(value)]
    return out


def _train_args(checkpoints: Path, **overrides) -> list[str]:
    values = {"steps": TRAIN_STEPS, "batch_size": TRAIN_BATCH, "lr": TRAIN_LR, "warmup": TRAIN_WARMUP, "weight_decay": TRAIN_DECAY,
              "clip": TRAIN_CLIP, "precision": "bf16", "every": TRAIN_EVERY, "checkpoints": checkpoints, "dropout": 0.1, "seed": TRAIN_SEED}
    values.update(overrides)
    return _args(**values) + [x for pair in TRAIN_MODEL.items() for x in pair]


def _target_lr(step: int, start: int = 0, end: int = 0) -> float:
    """The learning rate of optimizer step `step` (0-based): linear warm-up to lr, then a half cosine down to lr / 10.
    The cosine runs from step W + start (lr) to step S + end (lr / 10): the prompt's words fit three such schedules."""
    if step < TRAIN_WARMUP:
        return TRAIN_LR * (step + 1) / TRAIN_WARMUP
    progress = max(0.0, (step - TRAIN_WARMUP - start) / (TRAIN_STEPS + end - TRAIN_WARMUP - start))
    return TRAIN_LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# (start, end) of the cosine: CosineAnnealingLR's count (lr at step W + 1, lr / 10 one step after the last), lr at
# step W only and lr / 10 at the last step, or lr at steps W and W + 1 and lr / 10 at the last step
LR_SCHEDULES = [(0, 0), (-1, -1), (0, -1)]


def _launch(server, script: Path, args: list[str], folder: Path, **kwargs) -> list:
    runs = server.launch(script, args, folder, cwd=script.parent, **kwargs)
    if any(r.record and r.record.get("error") and "EADDRINUSE" in r.record["error"]["message"] for r in runs):
        for f in folder.glob("rank*"):
            f.unlink()
        runs = server.launch(script, args, folder, cwd=script.parent, **kwargs)  # another program took the port
    return runs


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _judge_launch(runs: list, stage: str, timeout: float, grace: float) -> None:
    """Errors first: a stub is 'not attempted'; otherwise the first rank's error, in one line, naming the rank."""
    errors = [(run.record["error"], run) for run in runs if run.record and run.record.get("error")]
    stubs = [err["stub"] for err, _run in errors if err["stub"]]
    if stubs:
        stub = stubs[0]
        if stub["file"] == "capstone_train.py":
            raise ExerciseNotAttempted(not_attempted_message("capstone_train"))
        raise ExerciseNotAttempted(_("not attempted yet: your script reaches the `raise NotImplementedError()` stub of "
                                     "{function} in {file}, an exercise before this one").format(
                                         function=stub["function"], file=stub["file"]))
    if errors:
        err, run = min(errors, key=lambda e: e[0]["time"])
        if err["type"] == "SystemExit":
            detail, code = _last_line(run.stderr), err["message"].split()[-1]
            if detail:
                raise ExerciseFailed(_("{stage}: rank {rank} exited with code {code}: {detail}").format(
                    stage=stage, rank=run.rank, code=code, detail=detail))
            raise ExerciseFailed(_("{stage}: rank {rank} exited with code {code}").format(stage=stage, rank=run.rank, code=code))
        at = (_(" ({file}, line {line}, in {function})").format(file=err["file"], line=err["line"], function=err["function"])
              if err["line"] else "")
        raise ExerciseFailed(_("{stage}: rank {rank} raised {error}: {message}{at}").format(
            stage=stage, rank=run.rank, error=err["type"], message=err["message"] or _("(no message)"), at=at))
    stopped = [run for run in runs if run.stopped]
    if stopped and len(stopped) == len(runs):
        raise ExerciseFailed(_("{stage}: no rank finished within {timeout:g} s, so they were stopped: does a rank wait in a "
                               "collective that another never calls?").format(stage=stage, timeout=timeout))
    if stopped:
        done = next(run for run in runs if not run.stopped)
        raise ExerciseFailed(_("{stage}: rank {rank} was still running {grace:g} s after rank {done} had ended, and was stopped: "
                               "does it wait in a collective that rank {done} never called (one inside `if rank == 0:`)?").format(
                                   stage=stage, rank=stopped[0].rank, grace=grace, done=done.rank))
    for run in runs:
        if run.record is None:
            code = run.returncode
            if code is not None and code < 0:
                how = _("killed by signal {signal}").format(signal=-code)
            else:
                how = _("exit code {code}").format(code=code)
            detail = _last_line(run.stderr)
            if detail:
                raise ExerciseFailed(_("{stage}: rank {rank} ended ({how}) before the script finished: {detail}").format(
                    stage=stage, rank=run.rank, how=how, detail=detail))
            raise ExerciseFailed(_("{stage}: rank {rank} ended ({how}) before the script finished").format(
                stage=stage, rank=run.rank, how=how))


def _state_of(step: dict) -> dict[str, torch.Tensor]:
    """The weights before an optimizer step, by parameter name."""
    return {name: w for name, w in zip(step.get("names", []), step["weights"]) if name}


def _first_difference(a: list, b: list) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x is None or y is None or not torch.equal(x, y)), None)


def _judge_optimizer(record: dict) -> None:
    steps = record["steps"]
    first = steps[0]
    if not first["optimizer"].endswith(".AdamW"):
        raise ExerciseFailed(_("training: the optimizer is {optimizer}, expected torch.optim.AdamW").format(
            optimizer=first["optimizer"].rsplit(".", 1)[-1]))
    names = first.get("names", [])
    if not names or "" in names:
        raise ExerciseFailed(_("training: the optimizer holds parameters that are not your TinyGPT's: give it the model's "
                               "parameters"))
    decays = [wd for size, wd in zip(first["group_sizes"], first["weight_decay"]) for _slot in range(size)]
    for name, weight, decay in zip(names, first["weights"], decays):
        want = TRAIN_DECAY if weight.ndim >= 2 else 0.0
        if abs(decay - want) > 1e-12:
            kind = _("a matrix") if weight.ndim >= 2 else _("a bias or norm weight")
            raise ExerciseFailed(_("training: {name} ({kind}, {ndim}-D) has weight decay {decay:g}, expected {expected:g}: decay "
                                   "the parameters of 2 or more dimensions by --weight-decay ({weight_decay:g}), the others by "
                                   "0").format(name=name, kind=kind, ndim=weight.ndim, decay=decay, expected=want,
                                               weight_decay=TRAIN_DECAY))
    if len(set(first["param_ids"])) != len(first["param_ids"]):
        raise ExerciseFailed(_("training: a parameter sits in two of the optimizer's groups"))
    fits = [schedule for schedule in LR_SCHEDULES
            if all(abs(lr - _target_lr(i, *schedule)) <= 1e-6 * TRAIN_LR for i, step in enumerate(steps) for lr in step["lr"])]
    for i, step in enumerate(steps):
        lrs = step["lr"]
        want = _target_lr(i)
        if not fits and any(abs(lr - want) > 1e-6 * TRAIN_LR for lr in lrs):
            raise ExerciseFailed(_("training: optimizer step {step} of {steps} ran with lr {lr:.6g}, expected {expected:.6g}: a "
                                   "linear warm-up over --warmup ({warmup}) steps from lr/{warmup} to --lr, then a half cosine "
                                   "down to lr/10 at the last step, one scheduler step per optimizer step").format(
                                       step=i + 1, steps=TRAIN_STEPS, lr=lrs[0], expected=want, warmup=TRAIN_WARMUP))
    norms = [step["grad_norm"] for step in steps]
    top = max(norms)
    if top > TRAIN_CLIP * (1 + 1e-3) and sum(abs(n - top) <= 1e-3 * top for n in norms) >= 2:
        raise ExerciseFailed(_("training: the gradient's norm reached {top:.3g} at {count} optimizer steps and never more: it is "
                               "clipped to {top:.3g}, not to --clip ({clip:g}); pass args.clip").format(
                                   top=top, count=sum(abs(n - top) <= 1e-3 * top for n in norms), clip=TRAIN_CLIP))
    for i, step in enumerate(steps):
        if step["grad_norm"] > TRAIN_CLIP * (1 + 1e-3):
            raise ExerciseFailed(_("training: the gradient's norm at optimizer step {step} was {norm:.3g}, above --clip {clip:g}: "
                                   "clip it (torch.nn.utils.clip_grad_norm_) after backward, before optimizer.step()").format(
                                       step=i + 1, norm=step["grad_norm"], clip=TRAIN_CLIP))


def _judge_data(runs: list, n_problems: int) -> None:
    per_rank = n_problems // len(runs)
    for run in runs:
        rec = run.record
        if not rec["orders"]:
            raise ExerciseFailed(_("training: rank {rank} never drew its indices from a DistributedSampler: give the DataLoader "
                                   "one (sampler=...), so that each rank reads its own share").format(rank=run.rank))
        sizes = {len(o["indices"]) for o in rec["orders"]}
        if sizes != {per_rank}:
            raise ExerciseFailed(_("training: rank {rank}'s DistributedSampler handed out {sizes} indices per epoch, expected "
                                   "{expected}: build it inside the process group, without num_replicas or rank").format(
                                       rank=run.rank, sizes=sorted(sizes), expected=per_rank))
        batches = {f["tokens"].shape[0] for f in rec["forwards"]}
        if batches != {TRAIN_BATCH}:
            raise ExerciseFailed(_("training: rank {rank} trained on batches of {sizes} problems, expected --batch-size "
                                   "({batch_size}) per rank").format(rank=run.rank, sizes=sorted(batches), batch_size=TRAIN_BATCH))
    from torch.utils.data.distributed import DistributedSampler

    def order(rank: int, epoch: int, seed: int) -> list[int]:
        sampler = DistributedSampler(range(n_problems), num_replicas=len(runs), rank=rank, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    for run in runs:
        drawn = run.record["orders"][0]
        if drawn["indices"] != order(run.rank, drawn["epoch"], TRAIN_SEED):
            seed = next((s for s in COMMON_SEEDS if drawn["indices"] == order(run.rank, drawn["epoch"], s)), None)
            if seed is not None:
                raise ExerciseFailed(_("training: rank {rank}'s DistributedSampler shuffles as one seeded with {seed}, not with "
                                       "--seed ({expected}): pass seed=args.seed").format(
                                           rank=run.rank, seed=seed, expected=TRAIN_SEED))
    first = [set(run.record["orders"][0]["indices"]) for run in runs]
    if first[0] & first[1]:
        raise ExerciseFailed(_("training: ranks 0 and 1 drew the same problems in their first epoch: each rank needs its own "
                               "share"))
    orders = [tuple(o["indices"]) for o in runs[0].record["orders"]]
    if len(orders) > 1 and len(set(orders)) == 1:
        raise ExerciseFailed(_("training: rank 0 read its problems in the same order in all {epochs} epochs: call "
                               "sampler.set_epoch(epoch) at the start of every epoch, on every rank").format(epochs=len(orders)))


def _saved_rng_holds(saved, state: torch.Tensor) -> bool:
    """Whether a rank's saved random states hold `state` (a tensor) anywhere inside."""
    if isinstance(saved, torch.Tensor):
        return saved.shape == state.shape and torch.equal(saved.to(state.dtype), state)
    if isinstance(saved, dict):
        return any(_saved_rng_holds(v, state) for v in saved.values())
    if isinstance(saved, (list, tuple)):
        return any(_saved_rng_holds(v, state) for v in saved)
    return False


def _saved_python_rng(saved, state) -> bool:
    if isinstance(saved, (list, tuple)) and len(saved) == 3 and saved[0] == state[0]:
        return tuple(saved[1]) == tuple(state[1])
    if isinstance(saved, dict):
        return any(_saved_python_rng(v, state) for v in saved.values())
    if isinstance(saved, (list, tuple)):
        return any(_saved_python_rng(v, state) for v in saved)
    return False


def _load_checkpoint(path: Path, stage: str) -> dict:
    try:
        checkpoint = torch.load(path, weights_only=True)
    except Exception as err:  # noqa: BLE001 -- the learner's file
        lines = [line.strip() for line in str(err).strip().splitlines()] or [""]
        reason = next((line for line in lines if "Unsupported global" in line), lines[0]).split(". ")[0][:120]
        raise ExerciseFailed(_("{stage}: {file} does not load with torch.load(weights_only=True) ({error}: {reason}): save "
                               "state_dicts, tensors and plain Python values").format(
                                   stage=stage, file=path.name, error=type(err).__name__, reason=reason)) from None
    if not isinstance(checkpoint, dict):
        raise ExerciseFailed(_("{stage}: {file} holds {got}, expected a dict").format(stage=stage, file=path.name, got=a_type(checkpoint)))
    return checkpoint


CHECKPOINT_KEYS = ("step", "model", "optimizer", "scheduler", "rng", "losses")


def _judge_checkpoints(runs: list, folder: Path) -> dict:
    """The run's checkpoints: who saved them, when, where, and what they hold. Returns the last one."""
    if runs[1].record["saves"]:
        raise ExerciseFailed(_("checkpoints: rank 1 called torch.save too: only rank 0 writes the checkpoints (if rank == 0:)"))
    saves = runs[0].record["saves"]
    want_steps = list(range(TRAIN_EVERY, TRAIN_STEPS + 1, TRAIN_EVERY))
    steps = [s["step"] for s in saves]
    if steps != want_steps:
        raise ExerciseFailed(_("checkpoints: rank 0 saved after steps {steps}, expected after {expected}: every --every "
                               "({every}) steps and after the last one, once each").format(
                                   steps=steps, expected=want_steps, every=TRAIN_EVERY))
    for save in saves:
        want = folder / f"step_{save['step']:06d}.pt"
        if Path(save["path"]).resolve() != want.resolve():
            raise ExerciseFailed(_("checkpoints: the checkpoint after step {step} went to {got!r}, expected {expected!r} in the "
                                   "--checkpoints folder").format(step=save["step"], got=Path(save["path"]).name, expected=want.name))
    world = len(runs)
    last = None
    for save in saves:
        step, path = save["step"], folder / f"step_{save['step']:06d}.pt"
        checkpoint = _load_checkpoint(path, _("checkpoints"))
        missing = [k for k in CHECKPOINT_KEYS if k not in checkpoint]
        if missing:
            what = _("every rank's random states") if missing[0] == "rng" else repr(missing[0])
            raise ExerciseFailed(_("checkpoints: {file} has no {key!r} entry: save {what} too; it holds {keys}").format(
                file=path.name, key=missing[0], what=what, keys=sorted(map(str, checkpoint))))
        if checkpoint["step"] != step:
            raise ExerciseFailed(_("checkpoints: {file}['step'] is {got!r}, expected {step}, the number of optimizer steps "
                                   "taken").format(file=path.name, got=checkpoint["step"], step=step))
        model = checkpoint["model"]
        if not isinstance(model, dict) or not all(isinstance(v, torch.Tensor) for v in model.values()):
            raise ExerciseFailed(_("checkpoints: {file}['model'] is not a state_dict: save model.state_dict()").format(file=path.name))
        if any(str(k).startswith("module.") for k in model):
            raise ExerciseFailed(_("checkpoints: {file}['model'] has keys like {key!r}, the DDP wrapper's: save the plain model's "
                                   "state_dict (ddp_model.module, or the model you wrapped)").format(
                                       file=path.name, key=next(iter(model))))
        weights = runs[0].record["final"] if step == TRAIN_STEPS else _state_of(runs[0].record["steps"][step])
        for name, value in weights.items():
            if name not in model or not torch.equal(model[name], value):
                raise ExerciseFailed(_("checkpoints: {file}['model'][{name!r}] is not the weights after step {step}").format(
                    file=path.name, name=name, step=step))
        optimizer, scheduler = checkpoint["optimizer"], checkpoint["scheduler"]
        if not isinstance(optimizer, dict) or set(optimizer) != {"state", "param_groups"}:
            raise ExerciseFailed(_("checkpoints: {file}['optimizer'] is not an optimizer's state_dict(): save "
                                   "optimizer.state_dict()").format(file=path.name))
        if not isinstance(scheduler, dict) or scheduler.get("last_epoch") != step:
            raise ExerciseFailed(_("checkpoints: {file}['scheduler'] is not the scheduler's state_dict() after {step} steps: save "
                                   "scheduler.state_dict()").format(file=path.name, step=step))
        rng = checkpoint["rng"]
        if not isinstance(rng, (list, tuple)) or len(rng) != world:
            size = _("{n} entries").format(n=len(rng)) if isinstance(rng, (list, tuple)) else a_type(rng)
            raise ExerciseFailed(_("checkpoints: {file}['rng'] is {got}, expected a list of {world}: every rank's random states "
                                   "(gather them with dist.all_gather_object), each rank's own restored when resuming").format(
                                       file=path.name, got=size, world=world))
        for rank, run in enumerate(runs):
            after = run.record["after"][step - 1]
            if not _saved_rng_holds(rng[rank], after["torch"]):
                raise ExerciseFailed(_("checkpoints: {file}['rng'][{rank}] lacks rank {rank}'s torch random state as it was when "
                                       "the checkpoint was saved, which dropout draws from").format(file=path.name, rank=rank))
            if not _saved_python_rng(rng[rank], after["python"]) or not _saved_rng_holds(rng[rank], after["numpy"]):
                raise ExerciseFailed(_("checkpoints: {file}['rng'][{rank}] lacks Python's or NumPy's random state: save every "
                                       "random state (course_utils.training.rng_state() gathers them)").format(
                                           file=path.name, rank=rank))
        losses = checkpoint["losses"]
        if not isinstance(losses, (list, tuple)) or len(losses) != step or not all(isinstance(v, float) for v in losses):
            raise ExerciseFailed(_("checkpoints: {file}['losses'] should be a list of {step} floats, one loss per step so "
                                   "far").format(file=path.name, step=step))
        last = checkpoint
    return last


def _judge_training(runs: list, folder: Path, n_problems: int) -> dict:
    for run in runs:
        rec = run.record
        if not rec["models"]:
            raise ExerciseFailed(_("training: rank {rank} never built a TinyGPT from capstone_model").format(rank=run.rank))
        if not any(rec["ddp_wraps"]):
            raise ExerciseFailed(_("training: rank {rank} never wrapped its TinyGPT in DistributedDataParallel").format(rank=run.rank))
        if not rec["forwards"]:
            raise ExerciseFailed(_("training: rank {rank} never ran a training forward pass of its TinyGPT (in train mode, "
                                   "with gradients)").format(rank=run.rank))
        if len(rec["steps"]) != TRAIN_STEPS:
            raise ExerciseFailed(_("training: rank {rank} took {steps} optimizer steps, expected --steps ({expected})").format(
                rank=run.rank, steps=len(rec["steps"]), expected=TRAIN_STEPS))
        if rec["initialized_at_end"]:
            raise ExerciseFailed(_("training: rank {rank} never called dist.destroy_process_group(): call it at the end, on every "
                                   "rank").format(rank=run.rank))
        if not all(f["autocast"] and f["dtype"] == "torch.bfloat16" for f in rec["forwards"]):
            raise ExerciseFailed(_("training: with --precision bf16, rank {rank}'s forward passes did not all run under "
                                   "torch.autocast('cpu', dtype=torch.bfloat16)").format(rank=run.rank))
    _judge_optimizer(runs[0].record)
    _judge_data(runs, n_problems)
    finals = [run.record["final"] for run in runs]
    if any(not torch.equal(finals[0][k], finals[1][k]) for k in finals[0]):
        raise ExerciseFailed(_("training: the ranks ended with different weights: their gradients were not averaged at every "
                               "step; run the forward through the DDP model, and start every rank from the same weights"))
    return _judge_checkpoints(runs, folder)


def _judge_resume(whole: list, killed: list, resumed: list, whole_last: dict, folder: Path) -> None:
    if not all(run.record and run.record.get("killed") for run in killed):
        raise ExerciseFailed(_("resume: the run to be stopped at step {step} did not get there").format(step=TRAIN_KILL_AT))
    latest = (TRAIN_KILL_AT // TRAIN_EVERY) * TRAIN_EVERY
    for run in resumed:
        loads = run.record["loads"]
        if not loads:
            raise ExerciseFailed(_("resume: rank {rank} of the relaunched run loaded no checkpoint: when --checkpoints holds "
                                   "some, load the latest and carry on from its step").format(rank=run.rank))
        if any(entry["weights_only"] is False for entry in loads):
            raise ExerciseFailed(_("resume: torch.load(..., weights_only=False) can run any code a checkpoint holds: load with "
                                   "weights_only=True"))
        read = [entry["step"] for entry in loads if entry["step"] is not None]
        if read and max(read) != latest:
            raise ExerciseFailed(_("resume: rank {rank} resumed from the checkpoint of step {step}, but step {latest}'s is the "
                                   "latest").format(rank=run.rank, step=max(read), latest=latest))
    steps = resumed[0].record["steps"]
    if len(steps) != TRAIN_STEPS - latest:
        raise ExerciseFailed(_("resume: the relaunched run took {steps} optimizer steps, expected {expected}: steps {first} to "
                               "{last}, after the {latest} its checkpoint holds").format(
                                   steps=len(steps), expected=TRAIN_STEPS - latest, first=latest + 1, last=TRAIN_STEPS,
                                   latest=latest))
    for run, uninterrupted in zip(resumed, whole):
        then, now = uninterrupted.record["steps"][latest], run.record["steps"][0]
        at = latest + 1
        if _first_difference(now["weights"], then["weights"]) is not None:
            raise ExerciseFailed(_("resume: when the run resumed at step {step}, rank {rank}'s weights were not those of the "
                                   "uninterrupted run: load the checkpoint's model state").format(step=at, rank=run.rank))
        moments = [m.get("exp_avg") for m in now["moments"]], [m.get("exp_avg") for m in then["moments"]]
        if _first_difference(*moments) is not None:
            raise ExerciseFailed(_("resume: when the run resumed at step {step}, AdamW's running averages were not those of the "
                                   "uninterrupted run: load the optimizer's state_dict").format(step=at))
        if now["lr"] != then["lr"]:
            raise ExerciseFailed(_("resume: when the run resumed at step {step}, the learning rate was {lr:.6g}, expected "
                                   "{expected:.6g}: load the scheduler's state_dict").format(
                                       step=at, lr=now["lr"][0], expected=then["lr"][0]))
        mine = next(f for f in run.record["forwards"] if f["step"] == 0)
        theirs = next(f for f in uninterrupted.record["forwards"] if f["step"] == latest)
        if not torch.equal(mine["tokens"], theirs["tokens"]):
            raise ExerciseFailed(_("resume: when the run resumed at step {step}, rank {rank} trained on another batch than the "
                                   "uninterrupted run: set the sampler's epoch to the resumed epoch and skip that epoch's "
                                   "batches already trained").format(step=at, rank=run.rank))
        if not torch.equal(mine["rng"], theirs["rng"]):
            if _one_draw_after(theirs["rng"], killed_state(killed, run.rank, latest), mine["rng"]):
                raise ExerciseFailed(_("resume: when the run resumed at step {step}, rank {rank}'s torch random state was one "
                                       "draw past the one it saved: a new DataLoader iterator draws a seed from the global "
                                       "generator, which dropout uses too; give the DataLoader a generator of its own "
                                       "(generator=torch.Generator())").format(step=at, rank=run.rank))
            raise ExerciseFailed(_("resume: when the run resumed at step {step}, rank {rank}'s torch random state (which "
                                   "dropout draws from) was not the uninterrupted run's: restore each rank's own saved random "
                                   "states").format(step=at, rank=run.rank))
    for run, uninterrupted in zip(resumed, whole):
        a, b = run.record["final"], uninterrupted.record["final"]
        different = [k for k in b if k not in a or not torch.equal(a[k], b[k])]
        if different:
            raise ExerciseFailed(_("resume: after resuming, rank {rank}'s final {name!r} is not bit for bit the uninterrupted "
                                   "run's").format(rank=run.rank, name=different[0]))
    last = _load_checkpoint(folder / f"step_{TRAIN_STEPS:06d}.pt", _("resume"))
    if list(last.get("losses", [])) != list(whole_last["losses"]):
        raise ExerciseFailed(_("resume: the resumed run's last checkpoint has other losses than the uninterrupted run's: keep "
                               "the losses so far in the checkpoint, and carry them on"))


def killed_state(killed: list, rank: int, step: int) -> torch.Tensor:
    """Rank `rank`'s torch random state right after optimizer step `step` of the stopped run: what its checkpoint saved."""
    return killed[rank].record["after"][step - 1]["torch"]


def _one_draw_after(expected: torch.Tensor, saved: torch.Tensor, got: torch.Tensor) -> bool:
    """Whether `got` is `saved` advanced by exactly one int64 draw, while the uninterrupted run had `saved` itself."""
    if not torch.equal(expected, saved):
        return False
    generator = torch.Generator()
    generator.set_state(saved)
    torch.empty((), dtype=torch.int64).random_(generator=generator)
    return torch.equal(generator.get_state(), got)


SCALE_PROBLEMS = [(9999, 9999), (1, 2), (3, 4), (2, 2), (0, 5), (6, 1), (4, 4), (7, 2)]  # one long answer, seven short


def _scale_hypotheses(script: Path, record: dict, sizes: dict) -> dict[str, torch.Tensor]:
    """Gradients, computed here with the learner's model, that one step on 2 ranks would give under each way of
    weighting the loss: the global batch's mean (right), the mean of the ranks' means, rank 0's own mean."""
    model_module = _learner_module(script.with_name("capstone_model.py"), "capstone_model")
    model = _build(model_module.TinyGPT, sizes).train()
    model.load_state_dict(_state_of(record["steps"][0]), strict=False)
    sums, counts, losses = [], [], []
    for tokens in record["batches"]:
        sequences = []
        for row in tokens.tolist():
            real = [t for t in row if t != PAD]
            sequences.append(torch.tensor(real + [END]))
        inputs, targets = collate(sequences)
        model.zero_grad()
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="sum")
        loss.backward()
        losses.append(loss.item())
        names = record["steps"][0]["names"]
        grads = dict(model.named_parameters())
        sums.append(torch.cat([grads[n].grad.flatten() for n in names]))
        counts.append(int((targets != IGNORE).sum()))
    total = sum(counts)
    return {"global": (sums[0] + sums[1]) / total, "means": (sums[0] / counts[0] + sums[1] / counts[1]) / 2,
            "rank 0": sums[0] / counts[0], "loss": torch.tensor(sum(losses) / total)}


def _judge_seed(script: Path, record: dict) -> None:
    """The first step's weights are TinyGPT's as built after torch.manual_seed(--seed); named only where a common
    hard-coded seed builds them instead (other random draws before the model are not the learner's fault)."""
    model_module = _learner_module(script.with_name("capstone_model.py"), "capstone_model")
    sizes = {"d_model": int(TRAIN_MODEL["--d-model"]), "n_heads": int(TRAIN_MODEL["--heads"]), "n_layers": int(TRAIN_MODEL["--layers"])}
    start = _state_of(record["steps"][0])

    def built_with(seed: int) -> bool:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            state = _build(model_module.TinyGPT, sizes, dropout=0.1).state_dict()
        return all(name in state and torch.equal(state[name], w) for name, w in start.items())

    if not built_with(TRAIN_SEED):
        seed = next((s for s in COMMON_SEEDS if built_with(s)), None)
        if seed is not None:
            raise ExerciseFailed(_("training: the model started from the weights torch.manual_seed({seed}) gives, not --seed "
                                   "({expected}): seed torch with args.seed before building the model").format(
                                       seed=seed, expected=TRAIN_SEED))


def _flat_grads(record: dict) -> torch.Tensor:
    return torch.cat([g.flatten() for g in record["steps"][0]["grads"]])


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _judge_global_loss(folder: Path, want: float) -> None:
    """The loss rank 0 saves for a step is the global batch's: the mean over the answer tokens of every rank."""
    path = folder / f"step_{1:06d}.pt"
    if not path.exists():
        return   # where the checkpoints go is judged on the full run
    losses = _load_checkpoint(path, _("checkpoints")).get("losses")
    if isinstance(losses, (list, tuple)) and losses and isinstance(losses[0], float) and abs(losses[0] - want) > 1e-4 * max(1.0, abs(want)):
        raise ExerciseFailed(_("checkpoints: on 2 ranks, the loss saved for step 1 is {loss:.5g}, but the global batch's loss "
                               "(its mean over both ranks' answer tokens) is {expected:.5g}: save the loss over the global "
                               "batch, all_reduce'd across the ranks").format(loss=losses[0], expected=want))


def _judge_scale(script: Path, two: list, one: list, folder: Path) -> None:
    for runs in (two, one):
        for run in runs:
            if len(run.record["steps"]) != 1:
                raise ExerciseFailed(_("scale: with --steps 1, rank {rank} took {steps} optimizer steps").format(
                    rank=run.rank, steps=len(run.record["steps"])))
            if any(f["autocast"] and f["dtype"] != "torch.float32" for f in run.record["forwards"]):
                raise ExerciseFailed(_("scale: with --precision fp32, the forward still ran under bfloat16 autocast"))
    distributed, single = _flat_grads(two[0].record), _flat_grads(one[0].record)
    record = dict(two[0].record)
    record["batches"] = [next(f["tokens"] for f in run.record["forwards"] if f["step"] == 0) for run in two]
    sizes = {"d_model": int(TRAIN_MODEL["--d-model"]), "n_heads": int(TRAIN_MODEL["--heads"]), "n_layers": int(TRAIN_MODEL["--layers"])}
    hypotheses = _scale_hypotheses(script, record, sizes)  # computed here, in float32, from the ranks' own batches
    right = hypotheses["global"]
    if _relative(single, right) > SCALE_TOLERANCE:
        if F.cosine_similarity(single, right, dim=0).item() > 1 - 1e-6:
            ratio = (single.norm() / right.norm()).item()
            raise ExerciseFailed(_("scale: in one process, the gradient is {ratio:.3g} times that of the mean cross-entropy over "
                                   "the batch's answer tokens: divide the summed loss by the number of answer tokens (targets != "
                                   "IGNORE)").format(ratio=ratio))
        raise ExerciseFailed(_("scale: in one process, the gradient is not that of the mean cross-entropy over the batch's "
                               "answer tokens (relative difference {difference:.2g})").format(difference=_relative(single, right)))
    off = _relative(distributed, single)
    if off <= SCALE_TOLERANCE:
        _judge_global_loss(folder, hypotheses["loss"].item())
        return
    stated = _("one step on 2 ranks x {per_rank} problems gave other gradients than one process on all {total} (relative "
               "difference {difference:.2g}, tolerance {tolerance:g})").format(
                   per_rank=len(SCALE_PROBLEMS) // 2, total=len(SCALE_PROBLEMS), difference=off, tolerance=SCALE_TOLERANCE)
    if _relative(distributed, hypotheses["means"]) < 1e-3:
        raise ExerciseFailed(_("scale: {stated}: each rank took the mean over its own answer tokens, and DDP averaged those "
                               "means, so a token on the rank with fewer counts more; divide each rank's summed loss by the "
                               "answer tokens of all ranks (all_reduce the count), times the world size").format(stated=stated))
    if _relative(distributed, hypotheses["rank 0"]) < 1e-3:
        raise ExerciseFailed(_("scale: {stated}: rank 0 stepped with its own gradient; run the forward through the DDP model, "
                               "which averages the gradients").format(stated=stated))
    if F.cosine_similarity(distributed, right, dim=0).item() > 1 - 1e-6:
        ratio = (distributed.norm() / right.norm()).item()
        raise ExerciseFailed(_("scale: {stated}: the gradient on 2 ranks is {ratio:.3g} times the right one (DDP averages the "
                               "ranks' gradients: scale each rank's loss by the world size once)").format(stated=stated, ratio=ratio))
    raise ExerciseFailed(_("scale: {stated}").format(stated=stated))


RUN_FOLDER = "run"   # where the notebook's launch puts its checkpoints, beside the learner's files


def _trained_model(script: Path) -> nn.Module:
    """The model of the notebook's training run: capstone_model's TinyGPT with the script's default sizes, its weights
    from the latest checkpoint in run/ beside the script."""
    folder = script.parent / RUN_FOLDER
    last = latest_checkpoint(folder)
    if last is None:
        raise ExerciseFailed(_("accuracy: there is no checkpoint in {folder}/ beside your script: run the launch cell above, "
                               "which trains your script, and let it finish").format(folder=RUN_FOLDER))
    module = _learner_module(script.with_name("capstone_model.py"), "capstone_model")
    model = _build(module.TinyGPT, LESSON_SIZES)
    checkpoint = _load_checkpoint(last, _("accuracy"))
    try:
        model.load_state_dict(checkpoint.get("model", {}))
    except Exception as err:  # noqa: BLE001 -- the learner's checkpoint
        raise ExerciseFailed(_("accuracy: {folder}/{file}['model'] does not load into {model}, the script's default sizes "
                               "({error}: {message})").format(
                                   folder=RUN_FOLDER, file=last.name, model=f"TinyGPT({_sizes(LESSON_SIZES, 0.0)})",
                                   error=type(err).__name__, message=_line(err)[:90])) from None
    return model.eval()


def _judge_accuracy(trained: nn.Module) -> None:
    problems = addition.problems_by_carries(ACCURACY_PROBLEMS, seed=20_260_611)
    answers = _learner_call(greedy, trained, prompts_of(problems), MAX_ANSWER, what=_("your trained model"))
    by_carries = accuracy_by_carries(answers, problems)
    shown = ", ".join(f"{c}: {a:.0%}" for c, a in by_carries.items())
    low = [c for c, a in by_carries.items() if a < ACCURACY_PER_CARRY]
    if low:
        raise ExerciseFailed(_("accuracy: your trained model answers {accuracy:.1%} of {n} hidden problems (by carries: "
                               "{by_carries}); at least {needed:.0%} of every carry count is needed, and {carries} carries got "
                               "less").format(accuracy=sum(by_carries.values()) / len(by_carries), n=len(problems),
                                              by_carries=shown, needed=ACCURACY_PER_CARRY, carries=low[0]))


@exercise("capstone_train")
def check_capstone_train(path) -> None:
    script = _expect_file(path, "capstone_train")
    if untouched_script(script):
        raise ExerciseNotAttempted(not_attempted_message("capstone_train"))
    limit = exercise_seconds()
    timeout, grace = max(5.0, limit / 3), 5.0
    problems = addition.problems(24, seed=2_468)
    from course_utils.capstone_probe import RankServer

    with tempfile.TemporaryDirectory(prefix="lesson11-check-") as tmp, RankServer() as server:
        folder = Path(tmp)
        whole = _launch(server, script, _train_args(folder / "whole"), folder / "probe-whole", problems=problems,
                        timeout=timeout, grace=grace)
        _judge_launch(whole, _("training"), timeout, grace)
        last = _judge_training(whole, folder / "whole", len(problems))
        killed = _launch(server, script, _train_args(folder / "resumed"), folder / "probe-killed", problems=problems,
                         timeout=timeout, grace=grace, kill_at=TRAIN_KILL_AT)
        resumed = _launch(server, script, _train_args(folder / "resumed"), folder / "probe-resumed", problems=problems,
                          timeout=timeout, grace=grace)
        _judge_launch(resumed, _("resume"), timeout, grace)
        _judge_resume(whole, killed, resumed, last, folder / "resumed")
        scale = {"steps": 1, "precision": "fp32", "clip": 1e6, "dropout": 0.0, "every": 1}
        two = _launch(server, script, _train_args(folder / "scale2", batch_size=len(SCALE_PROBLEMS) // 2, **scale),
                      folder / "probe-two", problems=SCALE_PROBLEMS, timeout=timeout, grace=grace)
        _judge_launch(two, _("scale"), timeout, grace)
        one = _launch(server, script, _train_args(folder / "scale1", batch_size=len(SCALE_PROBLEMS), **scale),
                      folder / "probe-one", world_size=1, problems=SCALE_PROBLEMS, timeout=timeout, grace=grace)
        _judge_launch(one, _("scale"), timeout, grace)
        with _stubs("capstone_train", script.parent):
            _judge_seed(script, whole[0].record)
            _judge_scale(script, two, one, folder / "scale2")
    with _stubs("capstone_train", script.parent):
        _judge_accuracy(_trained_model(script))
