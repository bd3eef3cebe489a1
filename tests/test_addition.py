"""course_utils.addition, the capstone's task: the same problems on every machine, carries counted right, the
constants consistent with the longest problem."""

import random

from course_utils import addition


def test_problems_are_the_same_for_the_same_seed_and_differ_between_seeds():
    assert addition.problems(50, seed=3) == addition.problems(50, seed=3)
    assert addition.problems(50, seed=3) != addition.problems(50, seed=4)
    assert addition.problems(3, seed=0) == [(7890, 4), (7634, 588), (697, 74)]  # Python's Random is stable across versions


def test_problems_mix_every_digit_count():
    numbers = [n for pair in addition.problems(2000, seed=1) for n in pair]
    assert all(0 <= n < 10 ** addition.DIGITS for n in numbers)
    assert {len(str(n)) for n in numbers} == set(range(1, addition.DIGITS + 1))


def test_training_problems_are_fixed():
    problems = addition.training_problems()
    assert len(problems) == addition.TRAINING_SIZE == 20_000
    assert problems == addition.training_problems()
    assert problems[:2] == addition.problems(2, addition.TRAINING_SEED)


def test_carries_counts_each_carry_of_the_written_addition():
    cases = {(0, 0): 0, (123, 45): 0, (5, 5): 1, (15, 85): 2, (999, 1): 3, (9999, 1): 4, (4567, 5678): 4, (5000, 5000): 1, (1, 9): 1}
    for (a, b), n in cases.items():
        assert addition.carries(a, b) == n, (a, b)
        assert addition.carries(b, a) == n


def test_carries_agrees_with_the_digits_themselves():
    rng = random.Random(0)
    for _ in range(500):
        a, b = rng.randrange(10_000), rng.randrange(10_000)
        carry = count = 0
        for i in range(addition.DIGITS):
            carry = (a // 10 ** i % 10 + b // 10 ** i % 10 + carry) // 10
            count += carry
        assert addition.carries(a, b) == count


def test_problems_by_carries_gives_each_count_in_order():
    problems = addition.problems_by_carries(7, seed=5)
    assert [addition.carries(a, b) for a, b in problems] == [c for c in range(addition.DIGITS + 1) for _ in range(7)]
    assert problems == addition.problems_by_carries(7, seed=5)
    assert addition.validation_problems(3) == addition.problems_by_carries(3, addition.VALIDATION_SEED)


def test_the_constants_fit_the_longest_problem():
    prompt = f"{9999:04d}+{9999:04d}="
    answer = str(9999 + 9999)[::-1] + "."
    assert len(prompt) == addition.PROMPT_LEN
    assert len(answer) == addition.MAX_ANSWER
    assert len(prompt) + len(answer) - 1 == addition.MAX_LEN  # the model never sees the last token
    assert len(addition.SYMBOLS) == addition.VOCAB_SIZE


def test_text_shows_every_token():
    tokens = list(range(10)) + [addition.PLUS, addition.EQUALS, addition.END, addition.PAD, addition.IGNORE, 99]
    assert addition.text(tokens) == "0123456789+=._-?"
