"""tools-tiny: multi-turn tool-use tasks small and regular enough for a tiny CPU model to learn.

Each task reads one to three one-line files with `read_file`, computes something trivial (a sum of
one-digit numbers, the largest of three, a word in capitals) and writes it with `write_file` to
answer.txt: two to four tool calls, short fixed-pattern instructions, a programmatic verifier.
Tasks are drawn deterministically from a seed; held-out tasks never repeat a training task.

`tools-tiny-faults` is the same tasks where a stated fraction (`FAULT_FRACTION`) carries one
transient fault: the first read of one of its input files fails with `error: b.txt: Resource
temporarily unavailable` (the ReAct harness's `read_file`, or `cat: b.txt: ...` through any
harness's shell), and the next read succeeds. Which tasks and which file are drawn from the seed
and the task's id, so every run and every model meets the same faults.

`oracle(task)` is the rule-based solver: the tool calls and final answer that solve a task, which
an SFT step distils into the model (in the Hermes `<tool_call>` format: `OracleCall.text()`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openforgerl.tasks.schema import Fault, PythonVerifier, Split, Task

ANSWER_FILE = "answer.txt"
FAULT_FRACTION = 0.5  # of tools-tiny-faults' tasks, train and held-out alike
FAULT_ERROR = "Resource temporarily unavailable"  # EAGAIN's message: a file briefly locked
VERIFIER = f"{__name__}:verify_answer"
_LETTERS = "abcdefgh"
# Few words and one-digit numbers: every answer is a small lookup a 2M-parameter model can learn
# from a few hundred trajectories; what it must learn is to carry values from the tool responses.
_WORDS = "cat dog sun map cup pen box hat red fox bee owl ant egg ice jam key log net oak".split()


def _numbers(count: int, low: int, high: int) -> Callable[[random.Random], list[int]]:
    return lambda rng: [rng.randint(low, high) for _ in range(count)]


def _word(rng: random.Random) -> list[str]:
    return [rng.choice(_WORDS)]


@dataclass(frozen=True, slots=True)
class _Family:
    name: str
    instruction: str  # {f0}, {f1}, {f2}: the input file names
    draw: Callable[[random.Random], list[Any]]  # one value per input file
    answer: Callable[[list[str]], str]  # from the files' stripped contents
    # The computation written out, from the values and the answer. Words are quoted: a word after
    # '"' has the same token ids as in a tool response and in the written JSON.
    working: Callable[[list[str], str], str]


def _shown(template: str) -> Callable[[list[str], str], str]:
    """A one-step working: `template` with {0}, {1}, {2} the values and {r} the answer."""
    return lambda v, r: template.format(*v, r=r)


def _counted(op: str) -> Callable[[list[str], str], str]:
    """Sums and differences in steps of one: 9 + 3 = 10 + 2 = 11 + 1 = 12 + 0 = 12.

    Each step needs only "one more" and "one less" of the step before, which every trajectory
    repeats: a small model can carry that to pairs it never saw, where a table of 100 sums it
    cannot (with one-step workings, held-out arithmetic passed 0.18-0.19 after SFT whether the
    teacher had shown those values or not)."""

    def working(v: list[str], r: str) -> str:
        a, b = int(v[0]), int(v[1])
        steps = [f"{a} {op} {b}"]
        while b > 0:
            a, b = (a + 1 if op == "+" else a - 1), b - 1
            steps.append(f"{a} {op} {b}")
        return " = ".join([*steps, r])

    return working


_FAMILIES = (
    _Family(
        "add",
        "Read {f0} and {f1}. Write their sum to answer.txt.",
        _numbers(2, 0, 9),
        lambda v: str(int(v[0]) + int(v[1])),
        _counted("+"),
    ),
    _Family(
        "sub",
        "Read {f0} and {f1}. Write the first minus the second to answer.txt.",
        lambda rng: sorted(_numbers(2, 0, 9)(rng), reverse=True),
        lambda v: str(int(v[0]) - int(v[1])),
        _counted("-"),
    ),
    _Family(
        "mul",
        "Read {f0} and {f1}. Write their product to answer.txt.",
        _numbers(2, 1, 5),
        lambda v: str(int(v[0]) * int(v[1])),
        _shown("{0} * {1} = {r}"),
    ),
    _Family(
        "max",
        "Read {f0}, {f1} and {f2}. Write the largest number to answer.txt.",
        _numbers(3, 0, 9),
        lambda v: str(max(int(x) for x in v)),
        _shown("max({0}, {1}, {2}) = {r}"),
    ),
    _Family(
        "copy",
        "Read {f0}. Write the same word to answer.txt.",
        _word,
        lambda v: v[0],
        _shown('"{0}" stays "{r}"'),
    ),
    _Family(
        "upper",
        "Read {f0}. Write the word in capitals to answer.txt.",
        _word,
        lambda v: v[0].upper(),
        _shown('"{0}" in capitals is "{r}"'),
    ),
    _Family(
        "reverse",
        "Read {f0}. Write the word backwards to answer.txt.",
        _word,
        lambda v: v[0][::-1],
        _shown('"{0}" backwards is "{r}"'),
    ),
)
FAMILIES: dict[str, _Family] = {f.name: f for f in _FAMILIES}


def transient_fault(name: str) -> Fault:
    """The first read of file `name` fails, by the ReAct harness's read_file or `cat` in a shell."""
    return Fault(tool="read_file", command="cat", match=name, error=f"{name}: {FAULT_ERROR}")


def keep_faults(tasks: list[Task], n: int) -> list[Task]:
    """`tasks` with the faults of only the first `n` that carry any; the others made clean."""
    keep = {t.id for t in [t for t in tasks if t.faults][:n]}
    return [t if t.id in keep else t.model_copy(update={"faults": []}) for t in tasks]


def generate(seed: int = 0, n_train: int = 1000, n_heldout: int = 50, faults: float = 0.0) -> list[Task]:
    """`n_train` train tasks then `n_heldout` held-out ones, the families taking turns; a fraction
    `faults` of them (drawn per task from the seed and its id) carries one transient fault."""
    rng = random.Random(seed)
    seen: set[tuple[Any, ...]] = set()
    tasks: list[Task] = []
    attempts = 0
    while len(tasks) < n_train + n_heldout:
        if attempts > 100 * (n_train + n_heldout):
            raise ValueError(f"cannot draw {n_train + n_heldout} distinct tools-tiny tasks")
        family = _FAMILIES[attempts % len(_FAMILIES)]
        attempts += 1
        values = family.draw(rng)
        names = [f"{letter}.txt" for letter in rng.sample(_LETTERS, len(values))]
        key = (family.name, *names, *values)
        if key in seen:
            continue
        seen.add(key)
        split: Split = "train" if len(tasks) < n_train else "heldout"
        index = len(tasks) if split == "train" else len(tasks) - n_train
        files = {name: f"{value}\n" for name, value in zip(names, values, strict=True)}
        task_id = f"tools-tiny-{split}-{index:04d}"
        # Its own generator: the tasks drawn stay the same whatever the fraction.
        draw = random.Random(f"faults:{seed}:{task_id}")
        faulted = draw.random() < faults
        fault = transient_fault(draw.choice(names)) if faulted else None
        tasks.append(
            Task(
                id=task_id,
                instruction=family.instruction.format(**{f"f{i}": n for i, n in enumerate(names)}),
                split=split,
                files=files,
                verifier=PythonVerifier(
                    python=VERIFIER,
                    kwargs={"expected": family.answer([str(v) for v in values])},
                ),
                timeout=120,
                faults=[fault] if fault else [],
                tags=["tools-tiny", family.name, *(["faulted"] if fault else [])],
                metadata={"family": family.name, "inputs": names, "seed": seed},
            )
        )
    return tasks


def verify_answer(workdir: Path, expected: str, path: str = ANSWER_FILE) -> dict[str, Any]:
    """Reward 1 when the answer file holds exactly `expected` (surrounding whitespace ignored)."""
    target = Path(workdir) / path
    if not target.is_file():
        return {"reward": 0.0, "expected": expected, "error": f"{path} is missing"}
    got = target.read_text(encoding="utf-8", errors="replace").strip()
    return {"reward": float(got == expected), "expected": expected, "got": got[:200]}


@dataclass(frozen=True, slots=True)
class OracleCall:
    name: str
    arguments: dict[str, str]

    def text(self) -> str:
        """The call as the model must write it (Hermes/Qwen format, the chat template's own)."""
        return f"<tool_call>\n{json.dumps({'name': self.name, 'arguments': self.arguments})}\n</tool_call>"


@dataclass(frozen=True, slots=True)
class OracleSolution:
    calls: tuple[OracleCall, ...]
    final_answer: str
    working: str  # the computation written out, e.g. "6 + 2 = 7 + 1 = 8 + 0 = 8"


def oracle(task: Task) -> OracleSolution:
    """The rule-based solution: read every input file, write the answer, say the answer.

    The answer is computed from the task's files, not taken from its verifier, so the tests can
    check the two against each other.
    """
    family = FAMILIES[task.metadata["family"]]
    names: list[str] = task.metadata["inputs"]
    assert isinstance(task.files, dict), "tools-tiny tasks carry their files inline"
    values = [task.files[n].strip() for n in names]
    answer = family.answer(values)
    reads = [OracleCall("read_file", {"path": n}) for n in names]
    write = OracleCall("write_file", {"path": ANSWER_FILE, "content": answer})
    return OracleSolution((*reads, write), answer, family.working(values, answer))
