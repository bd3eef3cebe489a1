"""The checker and the course's tooling, apart from what the lessons import.

- checks: the core every lesson's checks are written with (verdicts, `call`, `expect_*`);
- verdicts: what a check concluded, and how it is shown;
- checkcell, pytest_plugin, runner: the checker (nbval with the course's plugin) and how it is run;
- progress: verdicts recorded as checks run, scoreboards and the progress table;
- layout: where the course's files are, and each lesson's exercises;
- build: source notebooks -> the course's learner copies;
- workspace: the learner's own copies in work/ (made, reset, restored);
- grade, gradebook: a class graded (each submission in a sandbox), and the gradebook's tables, page and feedback;
- sandbox: the bubblewrap sandbox a graded submission runs in;
- tamper: a static scan of a submission for routes to fool the checker, named for review;
- autograder: a Gradescope autograder zip per lesson, and what its run_autograder runs (grade's grader, results.json);
- publish: the repository URL, each lesson's Colab/Kaggle set-up cell and badges (course_utils.hosted runs there);
- timings, classroom: the README's course map, static HTML for a classroom;
- cli: `python -m course_utils ...`.
"""
