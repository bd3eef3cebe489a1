"""Lesson 11 (the capstone): each check against the notebook's own five files, files written differently that must
pass, typical wrong ones that must fail with their fault named, the untouched skeletons, bad arguments, and no process
left behind by the checks or by the learner's copy of the notebook.

Speed: the training-script checks share one rank server (the check starts its own; here a shared one stands in for
it, with the same contract), and the checks that export to ONNX are run in full only where the ONNX stage is what is
tested; `test_the_real_checks_on_the_notebooks_files` runs every check as the checker does, once.
"""

import contextlib
import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
import torch

from course_utils import addition, capstone_probe
from course_utils import lesson11 as L
from course_utils.distributed import process_status
from course_utils.tooling.build import stub
from course_utils.tooling.checks import ExerciseFailed, ExerciseNotAttempted
from lesson_contract import assert_names_fault, assert_passes

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "solutions" / "11_capstone.ipynb"
LEARNER_COPY = ROOT / "notebooks" / "11_capstone.ipynb"
CHECKS = {name: getattr(L, f"check_{name}") for name in L.FILES}


def _cell(name: str) -> str:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    return next(c.source for c in nb.cells if f"exercise:{name}" in c.metadata.get("tags", []))


REFERENCE = {name: _cell(name).split("\n", 1)[1] + "\n" for name in L.FILES}  # without the %%writefile line
SKELETON = {name: stub(_cell(name)).split("\n", 1)[1] + "\n" for name in L.FILES}


def edited(name: str, *edits: tuple[str, str]) -> str:
    """The notebook's file `name` with each (old, new) replacement made; each old text must be there."""
    text = REFERENCE[name]
    for old, new in edits:
        assert old in text, f"not in the reference {name}.py: {old!r}"
        text = text.replace(old, new)
    return text


def project(folder: Path, **files: str) -> Path:
    """A project folder with the notebook's five files, some replaced by the given texts."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in L.FILES:
        (folder / f"{name}.py").write_text(files.get(name, REFERENCE[name]))
    return folder


@pytest.fixture(scope="module")
def shared_server():
    """One rank server for the module's training-script checks: starting one costs the imports of torch."""
    with capstone_probe.RankServer() as server:
        yield server


@pytest.fixture()
def fast_train(monkeypatch, shared_server):
    """check_capstone_train with the shared server in place of a new one (same class, same contract)."""

    class Shared:
        def __init__(self):
            pass

        def __enter__(self):
            return shared_server

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(capstone_probe, "RankServer", Shared)
    monkeypatch.setenv("COURSE_EXERCISE_SECONDS", os.environ.get("COURSE_EXERCISE_SECONDS", "60"))


@pytest.fixture(scope="module")
def trained_model():
    """A TinyGPT that the accuracy stage accepts: the course's own model, its weights set to answer correctly is not
    possible, so the stand-in is a model that adds (the check only decodes with it)."""
    return L.OracleAdder().eval()


# capstone_data

DATA_ALTERNATIVES = {
    "arithmetic, lazy items, a loop": (
        '"""Data."""\nimport torch\nfrom torch.utils.data import Dataset\nfrom course_utils import addition\n\n\n'
        "def encode(a, b):\n    def digits(n, width):\n        out = []\n        for _ in range(width):\n"
        "            n, d = divmod(n, 10)\n            out.append(d)\n        return out[::-1]\n"
        "    prompt = digits(a, 4) + [addition.PLUS] + digits(b, 4) + [addition.EQUALS]\n    total, answer = a + b, []\n"
        "    while True:\n        total, d = divmod(total, 10)\n        answer.append(d)\n        if total == 0:\n            break\n"
        "    return prompt, answer + [addition.END]\n\n\nclass AdditionDataset(Dataset):\n"
        "    def __init__(self, problems):\n        self.problems = list(problems)\n\n    def __len__(self):\n"
        "        return len(self.problems)\n\n    def __getitem__(self, index):\n        prompt, answer = encode(*self.problems[index])\n"
        "        return torch.tensor(prompt + answer, dtype=torch.long)\n\n\ndef collate(batch):\n"
        "    width = max(len(s) for s in batch) - 1\n    inputs = torch.full((len(batch), width), addition.PAD)\n"
        "    targets = torch.full((len(batch), width), addition.IGNORE)\n    for i, s in enumerate(batch):\n"
        "        inputs[i, :len(s) - 1] = s[:-1]\n        targets[i, addition.PROMPT_LEN - 1:len(s) - 1] = s[addition.PROMPT_LEN:]\n"
        "    return inputs, targets\n"),
    "F.pad and a position mask": edited(
        "capstone_data",
        ("    inputs = pad_sequence([s[:-1] for s in batch], batch_first=True, padding_value=PAD)\n"
         "    targets = pad_sequence([s[1:] for s in batch], batch_first=True, padding_value=IGNORE)\n"
         "    targets[:, :PROMPT_LEN - 1] = IGNORE       # the prompt is given, not predicted\n",
         "    import torch.nn.functional as F\n    longest = max(len(s) for s in batch)\n"
         "    inputs = torch.stack([F.pad(s[:-1], (0, longest - len(s)), value=PAD) for s in batch])\n"
         "    targets = torch.stack([F.pad(s[1:], (0, longest - len(s)), value=IGNORE) for s in batch])\n"
         "    in_prompt = torch.arange(longest - 1) < PROMPT_LEN - 1\n    targets = targets.masked_fill(in_prompt, IGNORE)\n"),
    ),
    "zfill, cat and clone": edited(
        "capstone_data",
        ('    prompt = [int(d) for d in f"{a:0{DIGITS}d}"] + [PLUS] + [int(d) for d in f"{b:0{DIGITS}d}"] + [EQUALS]\n'
         '    answer = [int(d) for d in reversed(str(a + b))] + [END]\n',
         "    prompt = [int(d) for d in str(a).zfill(DIGITS)] + [PLUS] + [int(d) for d in str(b).zfill(DIGITS)] + [EQUALS]\n"
         "    answer = list(map(int, str(a + b)[::-1])) + [END]\n"),
        ("        self.sequences = [torch.tensor(prompt + answer) for prompt, answer in (encode(a, b) for a, b in problems)]\n",
         "        self.sequences = [torch.cat([torch.tensor(p), torch.tensor(q)]) for p, q in map(lambda ab: encode(*ab), problems)]\n"),
        ("    targets = pad_sequence([s[1:] for s in batch], batch_first=True, padding_value=IGNORE)\n"
         "    targets[:, :PROMPT_LEN - 1] = IGNORE       # the prompt is given, not predicted\n",
         "    targets = inputs.clone()\n    targets[:, :-1] = inputs[:, 1:]\n"
         "    for i, s in enumerate(batch):\n        targets[i, len(s) - 2] = s[-1]\n        targets[i, len(s) - 1:] = IGNORE\n"
         "    targets[:, :PROMPT_LEN - 1] = IGNORE\n"),
    ),
}

PROMPT_LINE = '    prompt = [int(d) for d in f"{a:0{DIGITS}d}"] + [PLUS] + [int(d) for d in f"{b:0{DIGITS}d}"] + [EQUALS]\n'
ANSWER_LINE = "    answer = [int(d) for d in reversed(str(a + b))] + [END]\n"
INPUTS_LINE = "    inputs = pad_sequence([s[:-1] for s in batch], batch_first=True, padding_value=PAD)\n"
TARGETS_LINE = "    targets = pad_sequence([s[1:] for s in batch], batch_first=True, padding_value=IGNORE)\n"
IGNORE_PROMPT = "    targets[:, :PROMPT_LEN - 1] = IGNORE       # the prompt is given, not predicted\n"

DATA_WRONG = {
    "no leading zeros": (edited("capstone_data", (PROMPT_LINE, "    prompt = [int(d) for d in str(a)] + [PLUS] + [int(d) for d in str(b)] + [EQUALS]\n")),
                         r"^capstone_data: encode\(0, 0\): the prompt is '0\+0=', expected '0000\+0000=': write each number with 4 digits"),
    "answer most significant first": (edited("capstone_data", (ANSWER_LINE, "    answer = [int(d) for d in str(a + b)] + [END]\n")),
                                      r"encode\(9999, 9999\): the answer is '19998\.', expected '89991\.': the sum's digits go least significant first"),
    "no END": (edited("capstone_data", (ANSWER_LINE, "    answer = [int(d) for d in reversed(str(a + b))]\n")),
               r"encode\(0, 0\): the answer is '0', expected '0\.': end the answer with END \(12\)"),
    "answer of fixed length": (edited("capstone_data", (ANSWER_LINE, "    answer = [int(d) for d in reversed(f'{a + b:05d}')] + [END]\n")),
                               r"encode\(0, 0\): the answer is '00000\.', expected '0\.': write the sum's own digits, without padding"),
    "encode returns tensors": (edited("capstone_data", ("    return prompt, answer\n", "    return torch.tensor(prompt), torch.tensor(answer)\n")),
                               r"encode\(0, 0\)'s prompt is a tensor: return a list of Python ints"),
    "items are pairs": (edited("capstone_data", ("        return self.sequences[index]\n",
                                                 "        return self.sequences[index][:10], self.sequences[index][10:]\n")),
                        r"dataset\[0\] is a tuple, expected a 1-D int64 tensor of the prompt's and the answer's tokens"),
    "inputs padded with 0": (edited("capstone_data", (INPUTS_LINE, INPUTS_LINE.replace("padding_value=PAD", "padding_value=0"))),
                             r"collate pads the inputs with 0, the digit zero: pad them with PAD \(13\)"),
    "a loss that counts padding": (edited("capstone_data", (TARGETS_LINE, TARGETS_LINE.replace("padding_value=IGNORE", "padding_value=PAD"))),
                                   r"collate's targets hold 13 at padded positions: put IGNORE \(-100\) there, or the loss counts the padding"),
    "prompt not ignored": (edited("capstone_data", (IGNORE_PROMPT, "")),
                           r"collate's targets at the prompt's positions \(0 to 8\) are not IGNORE \(-100\)"),
    "first answer digit ignored": (edited("capstone_data", (IGNORE_PROMPT, "    targets[:, :PROMPT_LEN] = IGNORE\n")),
                                   r"collate's targets ignore position 9, whose target is the answer's first digit"),
    "targets not shifted": (edited("capstone_data", (TARGETS_LINE, TARGETS_LINE.replace("s[1:]", "s[:-1]"))),
                            r"collate's targets are the inputs themselves: the target at each position is the token after it"),
    "padded to the longest possible": (edited("capstone_data", (INPUTS_LINE, "    inputs = torch.stack([torch.cat([s[:-1], torch.full((15 - len(s) + 1,), PAD)]) for s in batch])\n")),
                                       r"collate's inputs have shape \(5, 15\), expected \(5, 14\): pad to the longest sequence of the batch"),
    "changes the batch in place": (edited("capstone_data", (INPUTS_LINE, INPUTS_LINE + "    batch[0][0] = 7\n")),
                                   r"collate changed the sequences it was given: build new tensors"),
}


@pytest.mark.parametrize("name", list(DATA_ALTERNATIVES))
def test_data_alternatives_pass(name, tmp_path):
    folder = project(tmp_path, capstone_data=DATA_ALTERNATIVES[name])
    assert_passes(L.check_capstone_data, folder / "capstone_data.py")


@pytest.mark.parametrize("name", list(DATA_WRONG))
def test_data_wrong_answers_name_their_fault(name, tmp_path):
    text, message = DATA_WRONG[name]
    assert_names_fault(L.check_capstone_data, project(tmp_path, capstone_data=text) / "capstone_data.py", message)


# capstone_model

ATTENTION_LINE = "        mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)\n"
INIT_BLOCK = ("        for module in self.modules():                    # GPT-2's initialisation\n"
              "            if isinstance(module, (nn.Linear, nn.Embedding)):\n"
              "                nn.init.normal_(module.weight, mean=0.0, std=0.02)\n"
              "            if isinstance(module, nn.Linear) and module.bias is not None:\n"
              "                nn.init.zeros_(module.bias)\n")
MLP_LINE = "        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))\n"

HAND_WRITTEN_MODEL = '''"""Attention by hand, as in lesson 03: a mask buffer, separate projections, no weight tying."""
import math

import torch
from torch import nn


class TinyGPT(nn.Module):
    def __init__(self, vocab_size, max_len, d_model, n_heads, n_layers, dropout=0.0):
        super().__init__()
        self.heads = n_heads
        self.tok, self.pos = nn.Embedding(vocab_size, d_model), nn.Embedding(max_len, d_model)
        self.layers = nn.ModuleList()
        for _ in range(n_layers):
            self.layers.append(nn.ModuleDict({
                "ln1": nn.LayerNorm(d_model), "q": nn.Linear(d_model, d_model), "k": nn.Linear(d_model, d_model),
                "v": nn.Linear(d_model, d_model), "o": nn.Linear(d_model, d_model), "ln2": nn.LayerNorm(d_model),
                "up": nn.Linear(d_model, 4 * d_model), "down": nn.Linear(4 * d_model, d_model)}))
        self.drop = nn.Dropout(dropout)
        self.ln, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab_size)
        self.register_buffer("future", torch.ones(max_len, max_len, dtype=torch.bool).triu(1), persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.data.normal_(0.0, 0.02)
            if isinstance(m, nn.Linear):
                m.bias.data.zero_()

    def forward(self, tokens):
        n, t = tokens.shape
        x = self.tok(tokens) + self.pos.weight[:t]
        for layer in self.layers:
            h = layer["ln1"](x)
            q, k, v = (layer[name](h).view(n, t, self.heads, -1).transpose(1, 2) for name in "qkv")
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
            weights = self.drop(scores.masked_fill(self.future[:t, :t], float("-inf")).softmax(-1))
            x = x + layer["o"]((weights @ v).transpose(1, 2).reshape(n, t, -1))
            x = x + self.drop(layer["down"](torch.nn.functional.gelu(layer["up"](layer["ln2"](x)))))
        return self.head(self.ln(x))
'''

MODEL_ALTERNATIVES = {
    "attention by hand, untied": HAND_WRITTEN_MODEL,
    "nn.MultiheadAttention with its mask": edited(
        "capstone_model",
        ("        self.qkv = nn.Linear(d_model, 3 * d_model)       # queries, keys and values in one product\n"
         "        self.out = nn.Linear(d_model, d_model)\n",
         "        self.attention = nn.MultiheadAttention(d_model, n_heads, dropout=dropout, batch_first=True)\n"),
        ("        n, t, d = x.shape\n"
         "        heads = self.qkv(self.attention_norm(x)).view(n, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)\n"
         "        q, k, v = heads.unbind(0)                        # each (N, heads, T, d / heads)\n"
         + ATTENTION_LINE +
         "        x = x + self.residual_dropout(self.out(mixed.transpose(1, 2).reshape(n, t, d)))\n",
         "        t = x.shape[1]\n        h = self.attention_norm(x)\n"
         "        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)   # True: may not attend\n"
         "        mixed, _ = self.attention(h, h, h, attn_mask=future, need_weights=False)\n"
         "        x = x + self.residual_dropout(mixed)\n"),
    ),
    "dropout in attention only, a ModuleList": edited(
        "capstone_model",
        ("        self.blocks = nn.Sequential(*[Block(d_model, n_heads, dropout) for _ in range(n_layers)])\n",
         "        self.blocks = nn.ModuleList([Block(d_model, n_heads, dropout) for _ in range(n_layers)])\n"),
        ("        return self.head(self.final_norm(self.blocks(x)))\n",
         "        for block in self.blocks:\n            x = block(x)\n        return self.head(self.final_norm(x))\n"),
        ("        self.residual_dropout = nn.Dropout(dropout)\n", "        self.residual_dropout = nn.Identity()\n"),
        ("        self.embed_dropout = nn.Dropout(dropout)\n", "        self.embed_dropout = nn.Identity()\n"),
    ),
}

MODEL_WRONG = {
    "peeks at future tokens": (edited("capstone_model", (ATTENTION_LINE, ATTENTION_LINE.replace("is_causal=True", "is_causal=False"))),
                               r"^capstone_model: model: changing the tokens from position 1 on changed the output at position 0: it peeks at later tokens"),
    "a mask one position too wide": (edited("capstone_model", (ATTENTION_LINE,
                                                               "        allowed = torch.ones(t, t, dtype=torch.bool).tril(1)\n"
                                                               + ATTENTION_LINE.replace("is_causal=True", "attn_mask=allowed"))),
                                     r"changed the output at position 0: it peeks at later tokens"),
    "no dropout": (edited("capstone_model", (ATTENTION_LINE, ATTENTION_LINE.replace("dropout_p=self.dropout if self.training else 0.0", "dropout_p=0.0")),
                          ("        self.residual_dropout = nn.Dropout(dropout)\n", "        self.residual_dropout = nn.Identity()\n"),
                          ("        self.embed_dropout = nn.Dropout(dropout)\n", "        self.embed_dropout = nn.Identity()\n")),
                   r"in train mode gave the same output twice: apply dropout"),
    "dropout in eval mode too": (edited("capstone_model", (ATTENTION_LINE, ATTENTION_LINE.replace("self.dropout if self.training else 0.0", "self.dropout"))),
                                 r"in eval mode gave two different outputs for the same tokens"),
    "default initialisation": (edited("capstone_model", (INIT_BLOCK, "")),
                               r"the Embedding 'embed' starts with weights of standard deviation 0\.9\d+: initialise every Linear and Embedding weight"),
    "over the budget": (edited("capstone_model", (MLP_LINE, MLP_LINE.replace("4 * d_model", "8 * d_model"))),
                        r"TinyGPT\(d_model=64, n_heads=4, n_layers=2, dropout=0\.0\) has 168,\d+ parameters, over the budget of 110,000"),
    "sizes ignored": (edited("capstone_model", ("        super().__init__()\n        ### BEGIN SOLUTION\n        self.embed",
                                                "        super().__init__()\n        ### BEGIN SOLUTION\n        d_model, n_heads = 64, 4\n        self.embed")),
                      r"TinyGPT\(d_model=24, n_heads=3, n_layers=2, dropout=0\.0\) has 101,952 parameters, more than the 15,528 of such a model"),
    "a parameter with no gradient": (edited("capstone_model", (INIT_BLOCK, "        self.spare = nn.Linear(d_model, d_model)\n" + INIT_BLOCK)),
                                     r"parameter 'spare\.weight' has no gradient: DistributedDataParallel refuses"),
    "only the last position's logits": (edited("capstone_model", ("        return self.head(self.final_norm(self.blocks(x)))\n",
                                                                  "        return self.head(self.final_norm(self.blocks(x)))[:, -1]\n")),
                                        r"returned shape \(1, 14\), expected \(1, 1, 14\)"),
}


@pytest.mark.parametrize("name", list(MODEL_ALTERNATIVES))
def test_model_alternatives_pass(name, tmp_path):
    assert_passes(L.check_capstone_model, project(tmp_path, capstone_model=MODEL_ALTERNATIVES[name]) / "capstone_model.py")


@pytest.mark.parametrize("name", list(MODEL_WRONG))
def test_model_wrong_answers_name_their_fault(name, tmp_path):
    text, message = MODEL_WRONG[name]
    assert_names_fault(L.check_capstone_model, project(tmp_path, capstone_model=text) / "capstone_model.py", message)


# capstone_decode

NEXT_LINE = "            next_tokens = model(tokens)[:, -1].argmax(dim=-1)      # the last position predicts the next token\n"

DECODE_ALTERNATIVES = {
    "only the unfinished rows": (
        '"""Decode."""\nimport torch\nfrom course_utils.addition import END\n\n\n'
        "def generate(model, prompts, max_new_tokens):\n    answers = [[] for _ in prompts]\n"
        "    live, tokens = list(range(len(prompts))), prompts.clone()\n    with torch.inference_mode():\n"
        "        for _ in range(max_new_tokens):\n            chosen = model(tokens).argmax(-1)[:, -1]\n            keep = []\n"
        "            for row, token in zip(live, chosen.tolist()):\n                if token != END:\n"
        "                    answers[row].append(token)\n                    keep.append(True)\n                else:\n"
        "                    keep.append(False)\n            mask = torch.tensor(keep)\n            if not mask.any():\n"
        "                break\n            tokens = torch.cat([tokens, chosen[:, None]], 1)[mask]\n"
        "            live = [row for row, k in zip(live, keep) if k]\n    return answers\n"),
    "a buffer filled in place": (
        '"""Decode."""\nimport torch\nfrom course_utils.addition import END, PAD\n\n\n'
        "@torch.inference_mode()\ndef generate(model, prompts, max_new_tokens):\n    n, p = prompts.shape\n"
        "    buffer = torch.full((n, p + max_new_tokens), PAD)\n    buffer[:, :p] = prompts\n    steps = 0\n"
        "    for t in range(p, p + max_new_tokens):\n        buffer[:, t] = model(buffer[:, :t])[:, -1].argmax(-1)\n        steps += 1\n"
        "        if (buffer[:, p:t + 1] == END).any(1).all():\n            break\n    answers = []\n"
        "    for row in buffer[:, p:p + steps].tolist():\n        answers.append(row[:row.index(END)] if END in row else row)\n"
        "    return answers\n"),
    "a while loop": edited(
        "capstone_decode",
        ("        for _ in range(max_new_tokens):\n", "        while len(answers[0]) < max_new_tokens + 1 and tokens.shape[1] < prompts.shape[1] + max_new_tokens:\n"),
    ),
}

DECODE_WRONG = {
    "one prompt at a time": (
        '"""Decode."""\nimport torch\nfrom course_utils.addition import END\n\n\ndef generate(model, prompts, max_new_tokens):\n'
        "    answers = []\n    with torch.inference_mode():\n        for prompt in prompts:\n            tokens, answer = prompt[None], []\n"
        "            for _ in range(max_new_tokens):\n                token = model(tokens)[0, -1].argmax().item()\n"
        "                if token == END:\n                    break\n                answer.append(token)\n"
        "                tokens = torch.cat([tokens, torch.tensor([[token]])], 1)\n            answers.append(answer)\n    return answers\n",
        r"ran the model on one prompt at a time \(\d+ calls of a batch of 1\): run the whole batch"),
    "no inference mode": (edited("capstone_decode", ("    with torch.inference_mode():\n", "    with torch.no_grad():\n")),
                          r"ran the model outside torch\.inference_mode\(\)"),
    "END kept in the answers": (edited("capstone_decode", ("                if next_tokens[row] != END:\n                    answers[row].append(next_tokens[row].item())\n",
                                                           "                answers[row].append(next_tokens[row].item())\n")),
                                r"the answer to 0\+0 is '0\.': leave END out of the answers"),
    "never stops early": (edited("capstone_decode", ("            if ended.all():\n                break\n", "")),
                          r"called the model 8 times, but every answer had ended after 6: one forward pass per new token, and stop as soon as"),
    "no limit but END": (edited("capstone_decode", ("        for _ in range(max_new_tokens):\n", "        for _ in range(6):\n")),
                         r"returned \[\[7, 7, 7, 7, 7, 7\]\], expected \[\[7, 7, 7\]\]: stop after max_new_tokens tokens"),
    "the first position's logits": (edited("capstone_decode", (NEXT_LINE, NEXT_LINE.replace("[:, -1]", "[:, 0]"))),
                                    r"the answer to 0\+0 is '________', expected '0'"),
    "sampling instead of the argmax": (edited("capstone_decode", (NEXT_LINE, "            next_tokens = torch.multinomial(model(tokens)[:, -1].softmax(-1), 1)[:, 0]\n")),
                                       r"generate\(a TinyGPT with random weights, 9 prompts, 6\): prompt \d got .*, greedy decoding gives"),
    "writes into the prompts": (edited("capstone_decode", ("            tokens = torch.cat([tokens, next_tokens[:, None]], dim=1)\n",
                                                           "            tokens = torch.cat([tokens, next_tokens[:, None]], dim=1)\n            prompts[:, -1] = PAD\n"),
                                       ("from course_utils.addition import END\n", "from course_utils.addition import END, PAD\n")),
                                r"changed the prompts it was given"),
    "a tensor of answers": (edited("capstone_decode", ("    return answers\n", "    return torch.tensor([a + [0] * (6 - len(a)) for a in answers])\n")),
                            r"returned a torch\.Tensor, expected a list of 7 lists of token ids"),
    "only the last token fed back": (edited("capstone_decode", ("            tokens = torch.cat([tokens, next_tokens[:, None]], dim=1)\n",
                                                                "            tokens = next_tokens[:, None]\n")),
                                     r"the answer to 0\+0 is '0_______', expected '0'"),
}


@pytest.mark.parametrize("name", list(DECODE_ALTERNATIVES))
def test_decode_alternatives_pass(name, tmp_path):
    assert_passes(L.check_capstone_decode, project(tmp_path, capstone_decode=DECODE_ALTERNATIVES[name]) / "capstone_decode.py")


@pytest.mark.parametrize("name", list(DECODE_WRONG))
def test_decode_wrong_answers_name_their_fault(name, tmp_path):
    text, message = DECODE_WRONG[name]
    assert_names_fault(L.check_capstone_decode, project(tmp_path, capstone_decode=text) / "capstone_decode.py", message)
