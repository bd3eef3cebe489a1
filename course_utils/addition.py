"""The capstone's task (lesson 11): adding two numbers of up to four digits, written as tokens.

Generated, never downloaded: `problems(n, seed)` draws the same pairs on every machine. A problem
(a, b) is the prompt "a+b=" with each number written with DIGITS digits, leading zeros included
(123 + 45 is "0123+0045="), followed by the answer: the digits of the sum, least significant first,
then the end token (168 is "861" and END). Writing the sum backwards lets a left-to-right model
produce each digit after the digits that decide its carry, as on paper.

Token ids: the digits 0-9 are themselves, then PLUS, EQUALS, END and PAD. How hard a problem is
is its number of carries (`carries`), 0 to DIGITS: a half-trained model fails the long carry chains.
"""

import random

DIGITS = 4
PLUS, EQUALS, END, PAD = 10, 11, 12, 13
VOCAB_SIZE = 14
IGNORE = -100                              # F.cross_entropy's default ignore_index: targets the loss skips
PROMPT_LEN = 2 * DIGITS + 2                # "0123+0045=": 10 tokens
MAX_ANSWER = DIGITS + 2                    # up to 5 digits, then END
MAX_LEN = PROMPT_LEN + DIGITS + 1          # the longest input a model sees: the prompt and 5 answer digits
SYMBOLS = "0123456789+=._"                 # how tokens print: END as '.', PAD as '_'

TRAINING_SEED, TRAINING_SIZE = 11, 20_000
VALIDATION_SEED = 12


def random_number(rng: random.Random) -> int:
    """A number of 1 to DIGITS digits, the digit count drawn uniformly first, so that short numbers are common."""
    n_digits = rng.randint(1, DIGITS)
    return rng.randint(0 if n_digits == 1 else 10 ** (n_digits - 1), 10 ** n_digits - 1)


def problems(n: int, seed: int) -> list[tuple[int, int]]:
    """n problems (a, b), the same for the same seed on every machine."""
    rng = random.Random(seed)
    return [(random_number(rng), random_number(rng)) for _ in range(n)]


def training_problems() -> list[tuple[int, int]]:
    """The 20,000 problems the capstone's training script trains on."""
    return problems(TRAINING_SIZE, TRAINING_SEED)


def carries(a: int, b: int) -> int:
    """How many carries the written addition a + b makes (0 to DIGITS): the problem's difficulty."""
    carry = count = 0
    while a or b:
        carry = int(a % 10 + b % 10 + carry >= 10)
        count += carry
        a, b = a // 10, b // 10
    return count


def problems_by_carries(per_count: int, seed: int) -> list[tuple[int, int]]:
    """per_count problems for each number of carries, 0 to DIGITS, in that order (long carry chains are rare in problems())."""
    rng = random.Random(seed)
    found: dict[int, list[tuple[int, int]]] = {c: [] for c in range(DIGITS + 1)}
    while min(len(group) for group in found.values()) < per_count:
        if rng.random() < 0.5:
            a, b = random_number(rng), random_number(rng)
        else:  # full-width numbers: where the long chains are
            a, b = rng.randrange(10 ** DIGITS), rng.randrange(10 ** DIGITS)
        group = found[carries(a, b)]
        if len(group) < per_count:
            group.append((a, b))
    return [p for c in range(DIGITS + 1) for p in found[c]]


def validation_problems(per_count: int = 100) -> list[tuple[int, int]]:
    """Problems for the learner's own evaluation, per_count for each number of carries."""
    return problems_by_carries(per_count, VALIDATION_SEED)


def text(tokens) -> str:
    """Token ids (a list or a 1-D tensor) as text: digits, '+', '=', '.' for END, '_' for PAD, '-' for IGNORE."""
    return "".join(SYMBOLS[t] if 0 <= t < len(SYMBOLS) else "-" if t == IGNORE else "?" for t in (int(t) for t in tokens))
