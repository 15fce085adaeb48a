"""tools-tiny-varied: tools-tiny's tasks with their train split asked in varied words, to train on.

A model trained on tools-tiny sees each family in one fixed sentence; RL on it raised held-out
pass@1 by 15 points but not pass@1 on the same skills asked in other words (tools-tiny-reworded,
issue #33). This suite is the RL side of that question: the same train tasks (ids, files, values,
verifier, oracle working), each asked in the family's sentence or in one of three train-side
paraphrases, which take turns (a quarter of the tasks keep tools-tiny's sentence). None of these
sentences is one of tools-tiny-reworded's, which stays held out from every training suite; the
held-out split is tools-tiny's own, unchanged, so `--split heldout` measures what tools-tiny does.
"""

from __future__ import annotations

from openforgerl.tasks.schema import Task
from openforgerl.tasks.suites import tools_tiny

SUITE = "tools-tiny-varied"

# Each family's train-side paraphrases ({f0}, {f1}, {f2}: the input files, in the order the oracle
# reads them), written apart from tools-tiny-reworded's sentences.
PARAPHRASES: dict[str, tuple[str, ...]] = {
    "add": (
        "Sum the numbers stored in {f0} and {f1}, then write that sum into answer.txt.",
        "Open {f0} and {f1}, add their two numbers together and record the answer in answer.txt.",
        "I need the number in {f0} plus the number in {f1} written to answer.txt.",
    ),
    "sub": (
        "Compute {f0}'s number minus {f1}'s number and write the difference into answer.txt.",
        "Open {f0} and {f1}; record the first number minus the second in answer.txt.",
        "I need {f0}'s number with {f1}'s number subtracted from it written to answer.txt.",
    ),
    "mul": (
        "Compute the product of the numbers stored in {f0} and {f1} and write it into answer.txt.",
        "Open {f0} and {f1}, multiply their two numbers together and record the answer in answer.txt.",
        "I need {f0}'s number and {f1}'s number multiplied, written to answer.txt.",
    ),
    "max": (
        "Look at the numbers stored in {f0}, {f1} and {f2}, then write the largest one into answer.txt.",
        "Open {f0}, {f1} and {f2}; record the greatest of their numbers in answer.txt.",
        "I need the largest value among {f0}, {f1} and {f2} written to answer.txt.",
    ),
    "copy": (
        "Look at the word stored in {f0}, then write it as it is into answer.txt.",
        "Open {f0} and record its word in answer.txt without changing it.",
        "I need the word from {f0} written to answer.txt exactly as it is.",
    ),
    "upper": (
        "Look at the word stored in {f0}, then write it in capital letters into answer.txt.",
        "Open {f0} and record its word in answer.txt with all its letters made capitals.",
        "I need {f0}'s word in block capitals written to answer.txt.",
    ),
    "reverse": (
        "Look at the word stored in {f0}, then write it backwards into answer.txt.",
        "Open {f0} and record its word in answer.txt with the letters in reverse order.",
        "I need {f0}'s word with its letters reversed written to answer.txt.",
    ),
}


def generate() -> list[Task]:
    """tools-tiny's tasks (seed 0), each train task of a family asked in its sentences in turn:
    tools-tiny's own, then each paraphrase; held-out tasks as tools-tiny asks them."""
    if set(PARAPHRASES) != set(tools_tiny.FAMILIES):
        raise AssertionError("every tools-tiny family needs its train-side paraphrases")
    counts = dict.fromkeys(tools_tiny.FAMILIES, 0)
    tasks: list[Task] = []
    for task in tools_tiny.generate():
        if task.split != "train":
            tasks.append(task)
            continue
        family: str = task.metadata["family"]
        turn = counts[family] % (1 + len(PARAPHRASES[family]))
        counts[family] += 1
        if turn:
            names = {f"f{i}": n for i, n in enumerate(task.metadata["inputs"])}
            task = task.model_copy(
                update={
                    "instruction": PARAPHRASES[family][turn - 1].format(**names),
                    "tags": [*task.tags, SUITE],
                    "metadata": {**task.metadata, "wording": turn},
                }
            )
        tasks.append(task)
    return tasks
