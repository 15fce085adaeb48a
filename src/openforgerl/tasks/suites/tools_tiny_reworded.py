"""tools-tiny-reworded: tools-tiny's skills asked in other words, held out from everything.

tools-tiny asks each family's task in one fixed sentence ("Read a.txt and b.txt. Write their sum to
answer.txt."), the same in its train and held-out splits. A model trained on it (SFT or RL) may
have learnt that sentence rather than the skill, so a gain measured on tools-tiny's held-out tasks
could be a gain on its wording alone. This suite asks for the same skills in other words: the same
seven families, value ranges, answer rule, verifier and oracle working, but each family asked in
2-3 other sentences that differ in wording and word order ("What do a.txt and b.txt add up to? Put
the total in answer.txt."). A gain from RL over SFT must hold here too to count as a gain in skill.

It is held-out only: every task's split is "heldout" (`openforge eval --tasks tools-tiny-reworded
--split heldout`), and it is only ever evaluated, never trained or tuned on. Tasks are drawn
deterministically from `SEED` (not tools-tiny's), the families taking turns and each family's
sentences taking turns, and none repeats a tools-tiny task's (family, files, values), train or
held-out. `tools_tiny.oracle` solves them (their metadata is tools-tiny's), and so does the oracle
teacher, which finds a task by its instruction.
"""

from __future__ import annotations

import random
from typing import Any

from openforgerl.tasks.schema import PythonVerifier, Task
from openforgerl.tasks.suites import tools_tiny

SUITE = "tools-tiny-reworded"
SEED = 33  # tools-tiny's is 0
N_PER_FAMILY = 10

# Each family's sentences ({f0}, {f1}, {f2}: the input files, in the order the oracle reads them).
TEMPLATES: dict[str, tuple[str, ...]] = {
    "add": (
        "What do {f0} and {f1} add up to? Put the total in answer.txt.",
        "Add the numbers in {f0} and {f1}; save the result as answer.txt.",
        "answer.txt should hold the total of the numbers found in {f0} and {f1}.",
    ),
    "sub": (
        "Take the number in {f1} away from the number in {f0} and put what is left in answer.txt.",
        "How much bigger is the number in {f0} than the one in {f1}? Save the difference as answer.txt.",
        "Subtract {f1}'s number from {f0}'s number; the result goes into answer.txt.",
    ),
    "mul": (
        "What is the number in {f0} times the number in {f1}? Put the product in answer.txt.",
        "Multiply {f0}'s number by {f1}'s number and save the result as answer.txt.",
        "answer.txt should hold the numbers from {f0} and {f1} multiplied together.",
    ),
    "max": (
        "Which is biggest: the number in {f0}, in {f1} or in {f2}? Save it as answer.txt.",
        "Find the highest of the numbers in {f0}, {f1} and {f2}, and put it in answer.txt.",
        "answer.txt should hold the maximum of the three numbers in {f0}, {f1} and {f2}.",
    ),
    "copy": (
        "Copy the word in {f0} into answer.txt, unchanged.",
        "Whatever word {f0} holds, save exactly that word as answer.txt.",
        "answer.txt should hold the very same word that is in {f0}.",
    ),
    "upper": (
        "Put the word from {f0} into answer.txt in upper case.",
        "Capitalise every letter of the word in {f0} and save it as answer.txt.",
        "answer.txt should hold {f0}'s word written in uppercase letters.",
    ),
    "reverse": (
        "Reverse the word in {f0} and save it as answer.txt.",
        "Spell the word from {f0} back to front, and put that in answer.txt.",
        "answer.txt should hold the word in {f0}, written from its last letter to its first.",
    ),
}


def task_key(task: Task) -> tuple[Any, ...]:
    """A tools-tiny(-reworded) task's (family, files, values): what the wording aside makes it."""
    names: list[str] = task.metadata["inputs"]
    assert isinstance(task.files, dict), "tools-tiny tasks carry their files inline"
    return (task.metadata["family"], *names, *[task.files[n].strip() for n in names])


def generate(seed: int = SEED, n_per_family: int = N_PER_FAMILY) -> list[Task]:
    """`n_per_family` held-out tasks of each family, none with the (family, files, values) of a
    task of the tools-tiny suite (its 1000 train and 50 held-out tasks)."""
    if set(TEMPLATES) != set(tools_tiny.FAMILIES):
        raise AssertionError("every tools-tiny family needs its reworded sentences")
    rng = random.Random(seed)
    seen = {task_key(t) for t in tools_tiny.generate()}
    families = list(tools_tiny.FAMILIES.values())
    counts = dict.fromkeys(tools_tiny.FAMILIES, 0)
    tasks: list[Task] = []
    total = n_per_family * len(families)
    attempts = 0
    while len(tasks) < total:
        if attempts > 1000 * total:
            raise ValueError(f"cannot draw {total} distinct {SUITE} tasks")
        family = families[len(tasks) % len(families)]  # the families take turns
        attempts += 1
        values = family.draw(rng)
        names = [f"{letter}.txt" for letter in rng.sample(tools_tiny._LETTERS, len(values))]
        key = (family.name, *names, *[str(v) for v in values])
        if key in seen:
            continue
        seen.add(key)
        templates = TEMPLATES[family.name]
        template = counts[family.name] % len(templates)  # the family's sentences take turns
        counts[family.name] += 1
        tasks.append(
            Task(
                id=f"{SUITE}-heldout-{len(tasks):04d}",
                instruction=templates[template].format(**{f"f{i}": n for i, n in enumerate(names)}),
                split="heldout",
                files={name: f"{value}\n" for name, value in zip(names, values, strict=True)},
                verifier=PythonVerifier(
                    python=tools_tiny.VERIFIER,
                    kwargs={"expected": family.answer([str(v) for v in values])},
                ),
                timeout=120,
                tags=[SUITE, family.name],
                metadata={"family": family.name, "inputs": names, "seed": seed, "template": template},
            )
        )
    return tasks
