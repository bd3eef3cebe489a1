"""Lesson 11 (the capstone): each check against the notebook's own five files, files written differently that must
pass, typical wrong ones that must fail with their fault named, the untouched skeletons, bad arguments, and no process
left behind by the launches or the checks (the notebook itself: `make test` runs it with --course-no-leftovers).

Speed: the training-script checks share one rank server (the check starts its own; here a shared one stands in for
it, with the same contract), and the checks that export to ONNX are run in full only where the ONNX stage is what is
tested; `test_the_real_checks_on_the_notebooks_files` runs every check as the checker does, once.
"""

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
import torch

from course_utils import addition, capstone_probe
from course_utils import lesson11 as L
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
    """check_capstone_train with the shared server in place of a new one (same class, same contract), and a model that
    adds in place of the notebook's trained one (the accuracy stage only decodes with it; its own tests load real files)."""

    monkeypatch.setattr(capstone_probe, "RankServer", lambda: contextlib.nullcontext(shared_server))
    monkeypatch.setattr(L, "_trained_model", lambda script: L.OracleAdder().eval())


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
    "padded first, then shifted": (edited("capstone_data", (INPUTS_LINE, "    inputs = pad_sequence(batch, batch_first=True, padding_value=PAD)[:, :-1]\n")),
                                   r"collate's inputs hold each shorter sequence's END \(12\) where its padding begins: drop every sequence's last token"),
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

MODEL_ALTERNATIVES["GELU written out with erf, positions from the table's rows"] = edited(
    "capstone_model",
    (MLP_LINE, "        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), Gelu(), nn.Linear(4 * d_model, d_model))\n"),
    ("class Block(nn.Module):", "class Gelu(nn.Module):\n    def forward(self, x):\n        return 0.5 * x * (1 + torch.erf(x / 2 ** 0.5))\n\n\nclass Block(nn.Module):"),
    ("self.position(positions)", "self.position.weight[:tokens.shape[1]]"),
)

FORWARD_RETURN = "        return self.head(self.final_norm(self.blocks(x)))\n"
BLOCK_ATTENTION = "        heads = self.qkv(self.attention_norm(x)).view(n, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)\n"

MODEL_WRONG = {
    "post-norm blocks": (edited("capstone_model", (BLOCK_ATTENTION, BLOCK_ATTENTION.replace("self.attention_norm(x)", "x")),
                                ("        x = x + self.residual_dropout(self.out(mixed.transpose(1, 2).reshape(n, t, d)))\n"
                                 "        return x + self.residual_dropout(self.mlp(self.mlp_norm(x)))\n",
                                 "        x = self.attention_norm(x + self.residual_dropout(self.out(mixed.transpose(1, 2).reshape(n, t, d))))\n"
                                 "        return self.mlp_norm(x + self.residual_dropout(self.mlp(x)))\n")),
                         r"the first block computes attention before any LayerNorm: each block is pre-norm"),
    "an MLP 2 * d_model wide": (edited("capstone_model", (MLP_LINE, MLP_LINE.replace("4 * d_model", "2 * d_model"))),
                                r"TinyGPT\(d_model=24, n_heads=3, n_layers=2, dropout=0\.0\)'s MLP is 48 wide, expected 4 \* d_model = 96"),
    "ReLU in the MLP": (edited("capstone_model", (MLP_LINE, MLP_LINE.replace("nn.GELU()", "nn.ReLU()"))),
                        r"'s MLP uses ReLU, expected GELU"),
    "a position table of fixed size": (edited("capstone_model", ("nn.Embedding(max_len, d_model)", "nn.Embedding(16, d_model)")),
                                       r"has a table of 16 positions, expected a learned position embedding of max_len \(15\) positions"),
    "one head, whatever n_heads": (edited("capstone_model", (BLOCK_ATTENTION, BLOCK_ATTENTION.replace("self.n_heads, d // self.n_heads", "1, d"))),
                                   r"'s attention runs with 1 head\(s\), expected n_heads=3"),
    "probabilities, not logits": (edited("capstone_model", (FORWARD_RETURN, FORWARD_RETURN.replace("(self.blocks(x)))", "(self.blocks(x))).softmax(-1)"))),
                                  r"returned probabilities \(each row sums to 1\): return the head's logits"),
    "no final LayerNorm": (edited("capstone_model", (FORWARD_RETURN, "        return self.head(self.blocks(x))\n")),
                           r"ran 4 LayerNorms, expected 5: two in each of the 2 blocks"),
    "every position vector added": (edited("capstone_model", ("self.position(positions)", "self.position.weight")),
                                    r"returned shape \(1, 15, 14\), expected \(1, 1, 14\): does it add all 15 position vectors instead of the first 1\?"),
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
                                    r"the answer to 0\+0 is '________', expected '0': generate took the argmax at position 0 of the 10 prompt tokens"),
    "model.eval() on a model that may be a function": (edited("capstone_decode", ("    answers = [[] for _ in range(len(prompts))]\n",
                                                                                 "    model.eval()\n    answers = [[] for _ in range(len(prompts))]\n")),
                                                       r"generate\(a plain function as the model, 2 prompts, 6\) raised AttributeError: .*only call it"),
    "stops when the first row ends": (edited("capstone_decode", ("            if ended.all():\n", "            if ended.any():\n")),
                                      r"the answer to 9999\+9999 is '89', expected '89991': it stopped before that row's END"),
    "tokens kept after END": (edited("capstone_decode", ("            for row in (~ended).nonzero().flatten().tolist():\n",
                                                         "            for row in range(len(prompts)):\n")),
                              r"the answer to 0\+0 is '0_+', expected '0': the row goes on after the model's END"),
    "answers turned most significant first": (edited("capstone_decode", ("    return answers\n", "    return [a[::-1] for a in answers]\n")),
                                              r"the answer to 9999\+9999 is '19998': the digits are reversed"),
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
                                     r"ran the model on fewer tokens than the prompt: feed it the prompt and the answer so far"),
}


@pytest.mark.parametrize("name", list(DECODE_ALTERNATIVES))
def test_decode_alternatives_pass(name, tmp_path):
    assert_passes(L.check_capstone_decode, project(tmp_path, capstone_decode=DECODE_ALTERNATIVES[name]) / "capstone_decode.py")


@pytest.mark.parametrize("name", list(DECODE_WRONG))
def test_decode_wrong_answers_name_their_fault(name, tmp_path):
    text, message = DECODE_WRONG[name]
    assert_names_fault(L.check_capstone_decode, project(tmp_path, capstone_decode=text) / "capstone_decode.py", message)


# capstone_train, on real ranks (the shared rank server), with problems, arguments and dropout the notebook never uses

SAMPLER = "    sampler = DistributedSampler(dataset, seed=args.seed)\n"
LOADER = "    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, collate_fn=collate, generator=torch.Generator())\n"
SET_EPOCH = "        sampler.set_epoch(epoch)\n"
AUTOCAST = '            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):\n'
LOSS = "            loss = loss_sum * world_size / tokens        # DDP averages over the ranks: this gives the global mean\n"
COUNT = "            dist.all_reduce(tokens)                      # the answer tokens of the global batch\n"
CLIP = "            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)\n"
SCHEDULER = "    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)\n"
GATHER = "                dist.all_gather_object(states, rng_state())   # a collective: every rank takes part\n"
SAVE_IF = "                if rank == 0:\n                    folder.mkdir(parents=True, exist_ok=True)\n"
RNG_ENTRY = '"scheduler": scheduler.state_dict(), "rng": states, "losses": losses},\n'
RESTORE_RNG = '        set_rng_state(checkpoint["rng"][rank])           # this rank\'s own random states\n'
LATEST = "        checkpoint = torch.load(saved[-1], weights_only=True)\n"
SKIP = "            if i < done_in_epoch:                        # trained before the checkpoint\n                continue\n"
GROUPS = ('    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": args.weight_decay},\n'
          '                                   {"params": vectors, "weight_decay": 0.0}], lr=args.lr)\n')
DESTROY = "    dist.destroy_process_group()\n"
SAVE_MODEL = '"model": model.state_dict()'

TRAIN_ALTERNATIVES = {
    "SequentialLR, gather_object to rank 0, a float count": edited(
        "capstone_train",
        (SCHEDULER, "    warm = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1 / args.warmup, total_iters=args.warmup - 1)\n"
                    "    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps - args.warmup, eta_min=args.lr / 10)\n"
                    "    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, cosine], milestones=[args.warmup])\n"),
        (GATHER, "                dist.gather_object(rng_state(), states if rank == 0 else None, dst=0)\n"),
        ("            tokens = (targets != addition.IGNORE).sum()\n", "            tokens = (targets != addition.IGNORE).sum().float()\n"),
        (LOSS, "            loss = loss_sum / (tokens / world_size)\n"),
    ),
    "a step function, an islice to resume, a seeded loader generator": edited(
        "capstone_train",
        ("import argparse\n", "import argparse\nimport itertools\n"),
        (LOADER, LOADER.replace("generator=torch.Generator()", "generator=torch.Generator().manual_seed(args.seed)")),
        ("        for i, (inputs, targets) in enumerate(loader):\n" + SKIP,
         "        for inputs, targets in itertools.islice(loader, done_in_epoch, None):\n"),
        (CLIP, "            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm=args.clip, norm_type=2.0)\n"),
        (SAVE_MODEL, '"model": ddp_model.module.state_dict()'),
    ),
    "its own random-state dict, torch.load's default, a try/finally": edited(
        "capstone_train",
        ("import argparse\n", "import argparse\nimport random\n\nimport numpy as np\n"),
        (GATHER, '                mine = {"torch": torch.get_rng_state(), "python": random.getstate(),\n'
                 '                        "numpy": torch.from_numpy(np.random.get_state()[1].astype(np.int64))}\n'
                 "                dist.all_gather_object(states, mine)\n"),
        (RESTORE_RNG, '        mine = checkpoint["rng"][rank]\n        torch.set_rng_state(mine["torch"])\n'
                      '        random.setstate((mine["python"][0], tuple(mine["python"][1]), mine["python"][2]))\n'
                      "        state = list(np.random.get_state())\n"
                      '        state[1] = mine["numpy"].numpy().astype(np.uint32)\n        np.random.set_state(tuple(state))\n'),
        (LATEST, "        checkpoint = torch.load(max(saved, key=lambda p: int(p.stem.split('_')[1])))\n"),
    ),
}

TRAIN_ALTERNATIVES["a cosine that reaches lr/10 at the last step"] = edited(
    "capstone_train",
    ("        if step < args.warmup:\n            return (step + 1) / args.warmup\n"
     "        progress = (step - args.warmup) / (args.steps - args.warmup)\n",
     "        if step < args.warmup:\n            return (step + 1) / args.warmup\n"
     "        progress = (step + 1 - args.warmup) / (args.steps - args.warmup)\n"),
)

TRAIN_WRONG = {
    "the rank's own loss saved": (edited("capstone_train", ("            dist.all_reduce(global_loss)\n", "")),
                                  r"checkpoints: on 2 ranks, the loss saved for step 1 is [\d.]+, but the global batch's loss .* is [\d.]+"),
    "a hard-coded seed": (edited("capstone_train", ("    torch.manual_seed(args.seed)\n", "    torch.manual_seed(0)\n")),
                          r"training: the model started from the weights torch\.manual_seed\(0\) gives, not --seed \(7\)"),
    "a sampler seeded with its default": (edited("capstone_train", (SAMPLER, "    sampler = DistributedSampler(dataset)\n")),
                                          r"training: rank 0's DistributedSampler shuffles as one seeded with 0, not with --seed \(7\)"),
    "a clip of its own": (edited("capstone_train", (CLIP, CLIP.replace("args.clip", "1.0"))),
                          r"training: the gradient's norm reached 1 at \d+ optimizer steps and never more: it is clipped to 1, not to --clip \(0\.05\)"),
    "a missing set_epoch": (edited("capstone_train", (SET_EPOCH, "")),
                            r"^capstone_train: training: rank 0 read its problems in the same order in all 4 epochs: call sampler\.set_epoch"),
    "saving on every rank": (edited("capstone_train", (SAVE_IF, "                if True:\n                    folder.mkdir(parents=True, exist_ok=True)\n")),
                             r"checkpoints: rank 1 called torch\.save too: only rank 0 writes the checkpoints"),
    "a checkpoint without random states": (edited("capstone_train", (RNG_ENTRY, '"scheduler": scheduler.state_dict(), "losses": losses},\n'),
                                                  (RESTORE_RNG, "")),
                                           r"checkpoints: step_000004\.pt has no 'rng' entry: save every rank's random states too"),
    "rank 0's random states only": (edited("capstone_train", (RNG_ENTRY, '"scheduler": scheduler.state_dict(), "rng": rng_state(), "losses": losses},\n'),
                                           (RESTORE_RNG, '        set_rng_state(checkpoint["rng"])\n')),
                                    r"checkpoints: step_000004\.pt\['rng'\] is a dict, expected a list of 2: every rank's random states"),
    "rank 0's states restored on every rank": (edited("capstone_train", (RESTORE_RNG, '        set_rng_state(checkpoint["rng"][0])\n')),
                                               r"resume: when the run resumed at step 9, rank 1's torch random state \(which dropout draws from\) was not"),
    "the global generator in the DataLoader": (edited("capstone_train", (LOADER, LOADER.replace(", generator=torch.Generator()", ""))),
                                               r"resume: .*torch random state was one draw past the one it saved: a new DataLoader iterator"),
    "the first checkpoint, not the latest": (edited("capstone_train", (LATEST, LATEST.replace("saved[-1]", "saved[0]"))),
                                             r"resume: rank 0 resumed from the checkpoint of step 4, but step 8's is the latest"),
    "each epoch from its start": (edited("capstone_train", (SKIP, "")),
                                  r"resume: when the run resumed at step 9, rank 0 trained on another batch than the uninterrupted run"),
    "weights_only=False": (edited("capstone_train", (LATEST, LATEST.replace("weights_only=True", "weights_only=False"))),
                           r"resume: torch\.load\(\.\.\., weights_only=False\) can run any code"),
    "a mean of the ranks' means": (edited("capstone_train", (COUNT, ""), (LOSS, "            loss = loss_sum / tokens\n")),
                                   r"scale: one step on 2 ranks x 4 problems .*each rank took the mean over its own answer tokens"),
    "a loss averaged over every position, padding included": (edited("capstone_train", ("            tokens = (targets != addition.IGNORE).sum()\n",
                                                                                        "            tokens = torch.tensor(targets.numel())\n")),
                                   r"scale: in one process, the gradient is 0\.\d+ times that of the mean cross-entropy over the batch's answer tokens"),
    "no clipping": (edited("capstone_train", (CLIP, "")), r"training: the gradient's norm at optimizer step 1 was .*above --clip 0\.05"),
    "no autocast": (edited("capstone_train", (AUTOCAST, "            with torch.autocast(\"cpu\", enabled=False):\n")),
                    r"training: with --precision bf16, rank 0's forward passes did not all run under torch\.autocast"),
    "a constant learning rate": (edited("capstone_train", (SCHEDULER, "    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)\n")),
                                 r"training: optimizer step 1 of 12 ran with lr 0\.02, expected 0\.00666667"),
    "weight decay on everything": (edited("capstone_train", (GROUPS, "    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)\n")),
                                   r"training: .* \(a bias or norm weight, 1-D\) has weight decay 0\.05, expected 0"),
    "never leaves the process group": (edited("capstone_train", (DESTROY + "    ### END SOLUTION", "    ### END SOLUTION")),
                                       r"training: rank 0 never called dist\.destroy_process_group\(\)"),
    "saves the DDP wrapper's state": (edited("capstone_train", (SAVE_MODEL, '"model": ddp_model.state_dict()')),
                                      r"checkpoints: step_000004\.pt\['model'\] has keys like 'module\."),
    "no DDP": (edited("capstone_train", ("    ddp_model = DDP(model)\n", "    ddp_model = model\n")),
               r"training: rank 0 never wrapped its TinyGPT in DistributedDataParallel"),
}


def test_the_reference_script_passes(tmp_path, fast_train, capsys):
    L.check_capstone_train(project(tmp_path) / "capstone_train.py")
    assert capsys.readouterr().out.strip() == "PASS capstone_train: all checks passed"


@pytest.mark.parametrize("name", list(TRAIN_ALTERNATIVES))
def test_train_alternatives_pass(name, tmp_path, fast_train):
    folder = project(tmp_path, capstone_train=TRAIN_ALTERNATIVES[name])
    verdict = L.check_capstone_train.verdict(folder / "capstone_train.py")
    assert verdict.passed, verdict.line()


@pytest.mark.parametrize("name", list(TRAIN_WRONG))
def test_train_wrong_answers_name_their_fault(name, tmp_path, fast_train):
    text, message = TRAIN_WRONG[name]
    folder = project(tmp_path, capstone_train=text)
    with pytest.raises(ExerciseFailed, match=message) as info:
        L.check_capstone_train(folder / "capstone_train.py")
    assert not isinstance(info.value, ExerciseNotAttempted)
    assert "\n" not in str(info.value) and "checker itself failed" not in str(info.value)


def test_the_accuracy_stage_names_a_missing_run_other_sizes_and_an_untrained_model(tmp_path):
    script = project(tmp_path) / "capstone_train.py"
    with pytest.raises(ExerciseFailed, match=r"^accuracy: there is no checkpoint in run/ beside your script: run the launch cell"):
        L._trained_model(script)
    model_module = L.load(script.with_name("capstone_model.py"))
    torch.manual_seed(0)
    (script.parent / "run").mkdir()
    small = model_module.TinyGPT(addition.VOCAB_SIZE, addition.MAX_LEN, 32, 4, 1)
    torch.save({"model": small.state_dict()}, script.parent / "run" / "step_000010.pt")
    with pytest.raises(ExerciseFailed, match=r"^accuracy: run/step_000010\.pt\['model'\] does not load into TinyGPT\(d_model=64, "
                                             r"n_heads=4, n_layers=2, dropout=0\.0\), the script's default sizes \(RuntimeError"):
        L._trained_model(script)
    untrained = model_module.TinyGPT(addition.VOCAB_SIZE, addition.MAX_LEN, 64, 4, 2)
    torch.save({"model": untrained.state_dict()}, script.parent / "run" / "step_000020.pt")
    with pytest.raises(ExerciseFailed, match=r"^accuracy: your trained model answers 0\.0% of 300 hidden problems \(by carries: 0: 0%, "
                                             r".*\); at least 90% of every carry count is needed, and 0 carries got less$"):
        L._judge_accuracy(L._trained_model(script))
    L._judge_accuracy(L.OracleAdder())  # a model that adds passes


def test_the_scale_diagnosis_is_certain_only_for_what_it_names(tmp_path, fast_train):
    """A script whose ranks step without averaging (DDP wrapped, but the forward through the plain model) is named as
    such by the scale stage only if it got that far; here the training stage sees the ranks' weights part first."""
    text = edited("capstone_train", ("                logits = ddp_model(inputs)\n", "                logits = model(inputs)\n"))
    with pytest.raises(ExerciseFailed, match=r"training: the ranks ended with different weights"):
        L.check_capstone_train(project(tmp_path, capstone_train=text) / "capstone_train.py")


def test_a_hanging_script_is_stopped(tmp_path, fast_train, monkeypatch):
    """Rank 0 sleeps before DDP, so rank 1 waits in DDP's first broadcast: both are stopped, within the check's time."""
    monkeypatch.setenv("COURSE_EXERCISE_SECONDS", "21")  # the ranks get 7 s of it
    text = edited("capstone_train", ("    rank, world_size = dist.get_rank(), dist.get_world_size()\n",
                                     "    rank, world_size = dist.get_rank(), dist.get_world_size()\n"
                                     "    if rank == 0:\n        import time\n        time.sleep(3600)\n"))
    start = time.monotonic()
    with pytest.raises(ExerciseFailed, match=r"training: no rank finished within 7 s, so they were stopped"):
        L.check_capstone_train(project(tmp_path, capstone_train=text) / "capstone_train.py")
    assert time.monotonic() - start < 21


# capstone_ship: the serve stage first (no export), then the exported program, then ONNX

EXAMPLE = "    example = torch.zeros(2, 3, dtype=torch.long)        # export specialises sizes 0 and 1: trace with 2 or more\n"
DIMS = '    sizes = {0: Dim("batch", min=1, max=1024), 1: Dim("length", min=1, max=MAX_LEN)}\n'
EXPORT = "    return torch.export.export(model.eval(), (example,), dynamic_shapes=(sizes,))\n"
ONNX = ('    torch.onnx.export(export_program(model), f=str(path), dynamo=True, input_names=["tokens"], output_names=["logits"],\n'
        "                      external_data=False, verbose=False)\n")
SERVE_LOOP = "    for start in range(0, len(requests), max_batch):\n"
SERVE_APPEND = '        answers += ["".join(str(d) for d in reversed(tokens)) for tokens in generate(model, prompts, MAX_ANSWER)]\n'

SHIP_ALTERNATIVES = {
    "the module to ONNX directly, two files, a stacked server": edited(
        "capstone_ship",
        (ONNX, '    torch.onnx.export(model.eval(), (torch.ones(3, 4, dtype=torch.long),), str(path), dynamo=True, verbose=False,\n'
               '                      dynamic_shapes=({0: Dim("n", min=1, max=1024), 1: Dim("t", min=1, max=MAX_LEN)},),\n'
               '                      input_names=["tokens"], output_names=["logits"])\n'),
        ("        prompts = torch.tensor([encode(*(int(n) for n in request.split(\"+\")))[0] for request in batch])\n",
         "        prompts = torch.stack([torch.tensor(encode(int(r.partition('+')[0]), int(r.partition('+')[2]))[0]) for r in batch])\n"),
    ),
    "Dim.DYNAMIC, a session with one thread, a server of lists": edited(
        "capstone_ship",
        (EXAMPLE, "    example = torch.randint(0, 10, (4, 5))\n"),
        (DIMS, "    sizes = {0: Dim.DYNAMIC, 1: Dim.DYNAMIC}\n"),
        ('    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])\n',
         "    options = ort.SessionOptions()\n    options.intra_op_num_threads = 1\n"
         '    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])\n'),
        (SERVE_APPEND, "        for tokens in generate(model, prompts, MAX_ANSWER):\n"
                       "            answers.append(str(sum(d * 10 ** i for i, d in enumerate(tokens))) if tokens else '')\n"),
    ),
    "strict export, a queue": edited(
        "capstone_ship",
        (EXPORT, "    model.eval()\n    return torch.export.export(model, (example,), dynamic_shapes=(sizes,), strict=True)\n"),
        ("    answers = []\n" + SERVE_LOOP + "        batch = requests[start:start + max_batch]\n",
         "    answers, queue = [], list(requests)\n    while queue:\n        batch, queue = queue[:max_batch], queue[max_batch:]\n"),
    ),
}

SHIP_WRONG = {
    "a server that runs one request at a time": (edited("capstone_ship", (SERVE_LOOP, "    max_batch = 1\n" + SERVE_LOOP)),
                                                 r"^capstone_ship: serve: serve\(a model that adds, 11 requests, max_batch=4\) ran the model on one request at a time"),
    "a server that ignores max_batch": (edited("capstone_ship", (SERVE_LOOP, "    max_batch = len(requests)\n" + SERVE_LOOP)),
                                        r"serve: .* ran a forward pass on 11 requests: at most max_batch at once"),
    "answers written backwards": (edited("capstone_ship", (SERVE_APPEND, SERVE_APPEND.replace("reversed(tokens)", "tokens"))),
                                  r"serve: the answer to '7\+5' is '21', expected '12': the model writes the digits least significant first"),
    "answers in another order": (edited("capstone_ship", (SERVE_LOOP, "    requests = sorted(requests, key=len)\n" + SERVE_LOOP)),
                                 r"serve: .* returned the right sums in another order .*: answer in the order of the requests"),
    "a batch of at most 64": (edited("capstone_ship", (DIMS, DIMS.replace("max=1024", "max=64"))),
                              r"ship: your exported program refuses tokens of shape \(1024, 2\) .*tokens\.size\(\)\[0\] <= 64"),
    "an example batch of 1": (edited("capstone_ship", (EXAMPLE, "    example = torch.zeros(1, 3, dtype=torch.long)\n")),
                              r"export_program\(model\) raised UserError: Constraints violated .*: export from an example of 2 or more"),
    "the TorchScript exporter": (edited("capstone_ship", (ONNX, '    torch.onnx.export(model.eval(), (torch.zeros(2, 3, dtype=torch.long),), str(path), dynamo=False,\n'
                                                               '                      input_names=["tokens"], output_names=["logits"],\n'
                                                               '                      dynamic_axes={"tokens": {0: "n", 1: "t"}, "logits": {0: "n", 1: "t"}})\n')),
                                 r"ship: export_onnx\(model, path, 6 prompts\) called torch\.onnx\.export\(\.\.\., dynamo=False\), the TorchScript exporter"),
    "answers as ints": (edited("capstone_ship", (SERVE_APPEND, '        answers += [int("".join(str(d) for d in reversed(t))) for t in generate(model, prompts, MAX_ANSWER)]\n')),
                        r"serve: the answer to '7\+5' is an int, expected a str such as '12'"),
    "an export specialised to batch 1": (edited("capstone_ship", (EXAMPLE, "    example = torch.zeros(1, 3, dtype=torch.long)\n"),
                                                (DIMS, "    sizes = {1: Dim('length', min=1, max=MAX_LEN)}\n")),
                                         r"ship: your exported program refuses tokens of shape \(2, 2\) .*: make the batch \(1 to 1024\) and the length"),
    "a fixed length": (edited("capstone_ship", (DIMS, '    sizes = {0: Dim("batch", min=1, max=1024)}\n')),
                       r"ship: your exported program refuses tokens of shape \(1, 1\)"),
    "exported in train mode": (edited("capstone_ship", (EXPORT, EXPORT.replace("model.eval()", "model"))),
                               r"ship: your exported program has dropout in its graph: the model was in train mode"),
    "an ONNX input named otherwise": (edited("capstone_ship", (ONNX, ONNX.replace('input_names=["tokens"]', 'input_names=["ids"]')),
                                             ('{"tokens": tokens.numpy()}', '{"ids": tokens.numpy()}')),
                                      r"ship: the ONNX file's inputs are \['ids'\] and outputs \['logits'\], expected \['tokens'\] and \['logits'\]"),
    "answers without running ONNX Runtime": (edited("capstone_ship", ("    return generate(onnx_model, prompts, MAX_ANSWER)\n",
                                                                      "    return generate(model.eval(), prompts, MAX_ANSWER)\n")),
                                             r"ship: export_onnx\(model, path, 6 prompts\) never ran ONNX Runtime"),
}


@pytest.mark.parametrize("name", list(SHIP_ALTERNATIVES))
def test_ship_alternatives_pass(name, tmp_path):
    assert_passes(L.check_capstone_ship, project(tmp_path, capstone_ship=SHIP_ALTERNATIVES[name]) / "capstone_ship.py")


@pytest.mark.parametrize("name", list(SHIP_WRONG))
def test_ship_wrong_answers_name_their_fault(name, tmp_path):
    text, message = SHIP_WRONG[name]
    assert_names_fault(L.check_capstone_ship, project(tmp_path, capstone_ship=text) / "capstone_ship.py", message)


# Every check: its file's skeleton is not attempted; bad arguments are one line; the reference passes.

@pytest.mark.parametrize("name", [n for n in L.FILES if n != "capstone_train"])
def test_the_notebooks_files_pass(name, tmp_path, capsys):
    CHECKS[name](project(tmp_path) / f"{name}.py")
    assert capsys.readouterr().out.strip() == f"PASS {name}: all checks passed"


@pytest.mark.parametrize("name", L.FILES)
def test_the_untouched_skeleton_is_not_attempted(name, tmp_path, fast_train):
    folder = project(tmp_path, **{name: SKELETON[name]})
    with pytest.raises(ExerciseNotAttempted, match=rf"^{name}: not attempted yet: replace `raise NotImplementedError` in {name} with your code$"):
        CHECKS[name](folder / f"{name}.py")


def test_a_half_written_script_that_still_reaches_its_stub_is_not_attempted(tmp_path, fast_train):
    """Told apart without starting a rank only when main() is the untouched skeleton; otherwise the ranks reach the stub."""
    half = SKELETON["capstone_train"].replace("    # YOUR CODE HERE\n", "    # YOUR CODE HERE\n    dist.init_process_group(\"gloo\")\n")
    assert half != SKELETON["capstone_train"]
    with pytest.raises(ExerciseNotAttempted, match=r"^capstone_train: not attempted yet: replace `raise NotImplementedError` in capstone_train"):
        L.check_capstone_train(project(tmp_path, capstone_train=half) / "capstone_train.py")
    moved = SKELETON["capstone_train"].replace("    raise NotImplementedError()", "    raise NotImplementedError(\"later\")")
    with pytest.raises(ExerciseFailed, match=r"training: rank \d raised NotImplementedError: later \(capstone_train\.py, line \d+, in main\)"):
        L.check_capstone_train(project(tmp_path, capstone_train=moved) / "capstone_train.py")


@pytest.mark.parametrize("name", ["capstone_model", "capstone_train", "capstone_ship"])
def test_an_earlier_skeleton_is_named(name, tmp_path, fast_train):
    """A finished file that uses an earlier file's untouched skeleton is 'not attempted', and the message says whose."""
    earlier = {"capstone_model": "capstone_data", "capstone_train": "capstone_model", "capstone_ship": "capstone_decode"}[name]
    folder = project(tmp_path, **{earlier: SKELETON[earlier]})
    if name == "capstone_model":  # TinyGPT does not use capstone_data: make it
        (folder / "capstone_model.py").write_text(REFERENCE["capstone_model"].replace(
            "import torch\n", "import torch\nfrom capstone_data import encode\nencode(1, 2)\n", 1))
    with pytest.raises(ExerciseNotAttempted, match=rf"not attempted yet: .*stub of \w+(\.\w+)? in {earlier}\.py|"
                                                  rf"not attempted yet: your code reaches the `raise NotImplementedError\(\)` stub"):
        CHECKS[name](folder / f"{name}.py")


@pytest.mark.parametrize("name", L.FILES)
@pytest.mark.parametrize("bad, message", [(None, "expected the path of your {name}.py, got None"),
                                          (3, r"expected the path of your {name}.py \(a str or pathlib.Path\), got an int"),
                                          (torch.nn.Linear(2, 2), r"expected the path of your {name}.py .*got a torch.nn"),
                                          ("elsewhere/{name}.py", r"{name}.py does not exist: run its %%writefile cell above"),
                                          ("other.py", r"expected the path of your {name}.py, got one of other.py")],
                         ids=["None", "int", "module", "missing", "another file"])
def test_bad_arguments_are_one_named_line(name, bad, message):
    bad = bad.format(name=name) if isinstance(bad, str) else bad
    with pytest.raises(ExerciseFailed, match=message.format(name=name)) as info:
        CHECKS[name](bad)
    assert "\n" not in str(info.value)


def test_a_file_that_does_not_parse_or_import_is_one_line(tmp_path):
    folder = project(tmp_path, capstone_data="def encode(a, b)\n    return a\n")
    with pytest.raises(ExerciseFailed, match=r"capstone_data\.py does not parse: SyntaxError at line 1"):
        L.check_capstone_data(folder / "capstone_data.py")
    (folder / "capstone_data.py").write_text("import torch\nraise ValueError('not today')\n")
    with pytest.raises(ExerciseFailed, match=r"importing capstone_data\.py raised ValueError: not today \(line 2\)"):
        L.check_capstone_data(folder / "capstone_data.py")
    (folder / "capstone_data.py").write_text(REFERENCE["capstone_data"] + "from course_utils.lesson11 import encode\n")
    with pytest.raises(ExerciseFailed, match=r"imports course_utils\.lesson11, the course's references and checks"):
        L.check_capstone_data(folder / "capstone_data.py")


def test_checks_leave_the_random_state_and_the_project_alone(tmp_path, fast_train):
    folder = project(tmp_path)
    before = sorted(p.name for p in folder.iterdir())
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    for name, check in CHECKS.items():
        assert check.verdict(folder / f"{name}.py").passed
    assert torch.equal(torch.rand(3), expected)
    assert sorted(p.name for p in folder.iterdir() if p.name != "__pycache__") == before


# No process outlives the lesson: the notebook's launches (torchrun) and the checks' rank servers, finished, killed,
# stopped for hanging or timed out, run in a child that adopts every orphan (a subreaper) and lists what is left.

LEAK_SCENARIO = r'''
import json, sys, time
from pathlib import Path
from course_utils import distributed, lesson11
from course_utils.tooling.runner import become_subreaper, descendants
from course_utils.distributed import process_status

assert become_subreaper()
folder = Path(sys.argv[1])
script = folder / "capstone_train.py"
tiny = ["--steps", "4", "--batch-size", "8", "--every", "2", "--d-model", "16", "--heads", "2", "--layers", "1"]
finished = distributed.torchrun(script.name, nproc=2, args=tiny + ["--checkpoints", str(folder / "tiny")], cwd=folder, timeout=300)
assert finished.returncode == 0 or distributed.aborted_on_exit(finished), finished.stderr[-2000:]
try:
    distributed.torchrun(script.name, nproc=2, args=tiny + ["--steps", "100000", "--checkpoints", str(folder / "long")], cwd=folder, timeout=6)
except TimeoutError:
    pass
verdict = lesson11.check_capstone_train.verdict(script)
assert verdict.reason.startswith("accuracy: there is no checkpoint"), verdict.line()  # every stage before it passed
hanging = folder / "hang" / "capstone_train.py"
hanging.parent.mkdir()
for name in lesson11.FILES:
    (hanging.parent / f"{name}.py").write_text((folder / f"{name}.py").read_text())
hanging.write_text(script.read_text().replace("    ddp_model = DDP(model)\n", "    if rank == 0:\n        time.sleep(3600)\n    ddp_model = DDP(model)\n").replace("import math\n", "import math\nimport time\n"))
import os
os.environ["COURSE_EXERCISE_SECONDS"] = "15"  # the ranks get 5 s of it
verdict = lesson11.check_capstone_train.verdict(hanging)
assert "no rank finished" in verdict.reason or "took longer" in verdict.reason, verdict.line()
time.sleep(1.0)
left = [pid for pid in descendants() if (status := process_status(pid)) and status[1] != "Z"]
commands = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:100] for pid in left}
print(json.dumps(commands))
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's /proc and PR_SET_CHILD_SUBREAPER")
def test_no_process_outlives_the_launches_and_the_checks(tmp_path):
    folder = project(tmp_path)
    result = subprocess.run([sys.executable, "-c", LEAK_SCENARIO, str(folder)], capture_output=True, text=True, timeout=600,
                            cwd=folder)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "{}", f"processes outlived the lesson: {result.stdout[-1000:]}"


# Whatever a learner's function returns or raises, the verdict is one line that never blames the checker.

HOSTILE = {"None": "return None", "an int": "return 0", "a string": "return 'x'", "a list": "return [1, 2]", "a dict": "return {}",
           "a tensor": "return torch.zeros(2, 3)", "NaNs": "return torch.full((3,), float('nan'))",
           "a numpy array": "import numpy\n    return numpy.zeros(3)", "an object": "return object()",
           "ValueError": "raise ValueError('mine')", "exit()": "import sys\n    sys.exit(1)"}
HOSTILE_SITES = {  # the file, and the line whose function's body is replaced by the hostile one
    "capstone_data": 'def encode(a: int, b: int) -> tuple[list[int], list[int]]:\n',
    "capstone_model": "    def forward(self, tokens: torch.Tensor) -> torch.Tensor:\n",
    "capstone_decode": "def generate(model, prompts: torch.Tensor, max_new_tokens: int) -> list[list[int]]:\n",
    "capstone_ship": "def serve(model, requests: list[str], max_batch: int) -> list[str]:\n",
}


def _hostile(name: str, body: str) -> str:
    text = REFERENCE[name]
    head = HOSTILE_SITES[name]
    indent = "        " if head.startswith("    ") else "    "
    start = text.index(head) + len(head)
    end = text.index("### END SOLUTION", start) + len("### END SOLUTION")
    docstring = text[start:text.index("\n", text.index('"""', start) + 3) + 1] if '"""' in text[start:start + 200] else ""
    return text[:start] + docstring + indent + body.replace("\n    ", "\n" + indent) + text[end:]


@pytest.mark.parametrize("name", list(HOSTILE_SITES))
@pytest.mark.parametrize("body", list(HOSTILE.values()), ids=list(HOSTILE))
def test_hostile_answers_are_one_line_and_the_learners(name, body, tmp_path):
    verdict = CHECKS[name].verdict(project(tmp_path, **{name: _hostile(name, body)}) / f"{name}.py")
    assert verdict.status == "failed", verdict
    assert "checker itself failed" not in verdict.reason and "\n" not in verdict.reason, verdict.reason
