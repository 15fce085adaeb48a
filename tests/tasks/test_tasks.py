"""Task files (YAML, JSONL), their validation errors, the local verifier runner and tools-tiny."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from openforgerl.tasks import (
    CommandVerifier,
    SetupError,
    Task,
    TaskError,
    VerifierError,
    dump_tasks,
    load_task_file,
    load_tasks,
    parse_verifier_output,
    prepare_local,
    register_suite,
    suite_names,
    verify_local,
)
from openforgerl.tasks.suites import tools_tiny, tools_tiny_reworded, tools_tiny_varied

GOOD = {"id": "t1", "instruction": "Write 1 to a.txt.", "split": "train", "verifier": {"command": "true"}}


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_yaml_forms_and_folders_relative_to_the_file(tmp_path: Path) -> None:
    write(tmp_path / "suite" / "files" / "t2" / "data.txt", "hello\n")
    single = write(
        tmp_path / "one.yaml", "id: solo\ninstruction: Do it.\nsplit: test\nverifier: {command: 'true'}\n"
    )
    listed = write(
        tmp_path / "suite" / "tasks.yaml",
        """
defaults:
  split: heldout
  timeout: 30
  resources: {memory: 512Mi, cpus: 0.5, pids: 64}
  verifier: {command: 'test -f out.txt', timeout: 5}
tasks:
  - id: t1
    instruction: Create out.txt.
    files: {notes/a.txt: "a\\n"}
  - id: t2
    instruction: Copy data.txt to out.txt.
    files: files/t2
    split: train
    harness: react
    harness_options: {max_turns: 4}
    verifier: {python: "pkg.mod:check", kwargs: {expected: 3}}
""",
    )
    (solo,) = load_task_file(single)
    assert (solo.id, solo.split, solo.timeout) == ("solo", "test", 600.0)
    t1, t2 = load_tasks(listed)
    assert t1.split == "heldout" and t1.timeout == 30 and t1.files == {"notes/a.txt": "a\n"}
    assert (t1.resources.memory, t1.resources.cpus, t1.resources.pids) == (512 * 2**20, 0.5, 64)
    assert t2.files == (tmp_path / "suite" / "files" / "t2").resolve() and t2.split == "train"
    assert (t2.harness, t2.harness_options, t2.verifier.kwargs) == (
        "react",
        {"max_turns": 4},
        {"expected": 3},
    )
    assert [t.id for t in load_tasks(listed, split="train")] == ["t2"]


def test_memory_units() -> None:
    def memory(value: object) -> int | None:
        return Task.model_validate({**GOOD, "resources": {"memory": value}}).resources.memory

    assert memory("512Mi") == memory("512MiB") == 512 * 2**20
    assert memory("1G") == memory("1GB") == 10**9
    assert memory(1 << 30) == 1 << 30


def test_jsonl_round_trip(tmp_path: Path) -> None:
    folder = tmp_path / "files"
    write(folder / "x.txt", "x")
    tasks = [
        Task.model_validate({**GOOD, "files": str(folder), "tags": ["a"], "resources": {"memory": "1Gi"}}),
        Task.model_validate({**GOOD, "id": "t2", "verifier": {"python": "m:f", "kwargs": {"n": 1}}}),
    ]
    dump_tasks(tasks, tmp_path / "tasks.jsonl")
    assert load_tasks(tmp_path / "tasks.jsonl") == tasks


BAD_CASES = [
    ({"instruction": None}, "instruction"),
    ({"split": "dev"}, "split"),
    ({"verfier": {"command": "true"}}, "verfier"),  # a typo is an error, not a silently ignored key
    ({"files": {"../escape.txt": "x"}}, "files"),
    ({"files": "no-such-folder"}, "no-such-folder"),
    ({"verifier": {"python": "not a callable"}}, "verifier.python"),
    ({"verifier": "true"}, "a verifier is {command"),
    ({"verifier": {"command": "true", "files": "missing-verifier"}}, "missing-verifier"),
    ({"resources": {"memory": "lots"}}, "resources.memory"),
    ({"timeout": -1}, "timeout"),
    ({"id": "has space"}, "id"),
    # Absurd settings (#35): refused at load, naming the field, not failed mid-run as infrastructure.
    ({"resources": {"cpus": 1e9}}, "resources.cpus: Input should be less than or equal to 1024"),
    ({"resources": {"cpus": 0.001}}, "resources.cpus: Input should be greater than or equal to 0.01"),
    (
        {"resources": {"memory": 1}},
        "resources.memory: Value error, memory must be from 16MiB to 1TiB, not 1B",
    ),
    ({"resources": {"memory": "1Mi"}}, "resources.memory: Value error, memory must be from 16MiB"),
    ({"resources": {"memory": "2Ti"}}, "resources.memory: Value error, memory must be from 16MiB"),
    ({"resources": {"pids": 10**12}}, "resources.pids: Input should be less than or equal to 4194304"),
    ({"timeout": float("inf")}, "timeout: Input should be a finite number"),
    ({"timeout": 0}, "timeout: Input should be greater than 0"),
    ({"timeout": 1e9}, "timeout: Input should be less than or equal to 604800"),
    (
        {"verifier": {"command": "true", "timeout": float("nan")}},
        "verifier.command.timeout: Input should be a finite",
    ),
    (
        {"solution": {"command": "true", "timeout": float("inf")}},
        "solution.timeout: Input should be a finite",
    ),
]


@pytest.mark.parametrize(("change", "field"), BAD_CASES)
def test_a_bad_task_names_the_file_the_task_and_the_problem(tmp_path: Path, change: dict, field: str) -> None:
    ok = {**GOOD, "id": "fine"}
    bad = {k: v for k, v in {**GOOD, "id": "broken", **change}.items() if v is not None}
    path = write(tmp_path / "tasks.yaml", json.dumps({"tasks": [ok, bad]}))  # JSON is YAML
    with pytest.raises(TaskError) as info:
        load_tasks(path)
    message = str(info.value)
    assert str(path) in message and field in message
    assert ("'has space'" if change.get("id") else "'broken'") in message and "entry 2" in message
    assert "'fine'" not in message


def test_every_bad_task_of_a_file_is_reported(tmp_path: Path) -> None:
    path = write(
        tmp_path / "t.jsonl", "\n".join(json.dumps({**GOOD, "id": f"t{i}", "split": "x"}) for i in range(3))
    )
    with pytest.raises(TaskError) as info:
        load_tasks(path)
    assert [line.split(": task ")[1][:4] for line in str(info.value).splitlines()] == ["'t0'", "'t1'", "'t2'"]
    assert "line 3" in str(info.value)


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("bad.jsonl", '{"id": "a"\n', "line 1: not valid JSON"),
        ("bad.yaml", "id: [unclosed\n", "not valid YAML"),
        ("bad.yaml", "42\n", "expected a task"),
        ("bad.yaml", "tasks: []\nextra: 1\n", "unexpected keys: ['extra']"),
    ],
)
def test_malformed_files(tmp_path: Path, name: str, text: str, expected: str) -> None:
    path = write(tmp_path / name, text)
    with pytest.raises(TaskError, match="bad") as info:
        load_tasks(path)
    assert expected in str(info.value)


def test_folder_loading_is_flat_and_ids_are_unique(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", json.dumps(GOOD))
    write(tmp_path / "b.jsonl", json.dumps({**GOOD, "id": "t2"}) + "\n")
    write(tmp_path / "t2" / "config.yaml", "not: a task\n")  # a task's own files are never loaded as tasks
    assert [t.id for t in load_tasks(tmp_path)] == ["t1", "t2"]
    write(tmp_path / "c.yaml", json.dumps(GOOD))
    with pytest.raises(TaskError, match=r"c\.yaml: task 't1': duplicate id \(also in .*a\.yaml\)"):
        load_tasks(tmp_path)
    with pytest.raises(TaskError, match="no task files"):
        load_tasks(write(tmp_path / "empty" / "x.txt", "").parent)


def test_unknown_name_lists_the_suites(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="built-in suites: claw-basic, tools-tiny"):
        load_tasks("no-such-suite")
    assert {"claw-basic", "tools-tiny"} <= set(suite_names())
    with pytest.raises(ValueError, match="looks like a path"):
        register_suite("my/suite", list)


@pytest.mark.parametrize(
    ("stdout", "code", "reward", "details"),
    [
        ('log line\n{"reward": 0.25, "why": "half"}\n', 0, 0.25, {"why": "half"}),
        ('{"reward": true}', 1, 1.0, {}),
        ("all good\n", 0, 1.0, {"exit_code": 0}),
        ("", 1, 0.0, {"exit_code": 1}),
    ],
)
def test_parse_verifier_output(stdout: str, code: int, reward: float, details: dict) -> None:
    result = parse_verifier_output(stdout, code)
    assert (result.reward, result.details) == (reward, details)


@pytest.mark.parametrize(
    ("stdout", "code", "problem"),
    [
        ("", 2, "exited with status 2"),
        ('{"reward": 1.5}', 0, r"in \[0, 1\]"),
        ('{"score": 1}', 0, "no 'reward'"),
        ("{not json", 0, "not valid JSON"),
        ('{"reward": NaN}', 0, "not valid JSON"),
    ],
)
def test_verifier_failures_are_errors_not_rewards(stdout: str, code: int, problem: str) -> None:
    with pytest.raises(VerifierError, match=problem):
        parse_verifier_output(stdout, code)


def test_command_verifier_runs_in_the_workdir_with_hidden_files(tmp_path: Path) -> None:
    task = Task.model_validate(
        {
            **GOOD,
            "files": {"in.txt": "3\n"},
            "setup": ["cp in.txt copy.txt"],
            "verifier": {
                "command": 'sh "$OPENFORGE_VERIFIER_DIR/check.sh" "$OPENFORGE_TASK_ID"',
                "files": {"check.sh": 'test "$(cat copy.txt)" = 3 && test "$1" = t1 && test ! -e check.sh\n'},
            },
        }
    )
    work = tmp_path / "work"
    prepare_local(task, work)
    assert sorted(p.name for p in work.iterdir()) == ["copy.txt", "in.txt"]
    assert verify_local(task, work).reward == 1.0
    (work / "copy.txt").write_text("4\n")
    assert verify_local(task, work).reward == 0.0

    slow = task.model_copy(update={"verifier": CommandVerifier(command="sleep 5", timeout=0.2)})
    with pytest.raises(VerifierError, match="timeout"):
        verify_local(slow, work)
    with pytest.raises(SetupError, match="exited with 3"):
        prepare_local(task.model_copy(update={"setup": ["exit 3"]}), tmp_path / "other")


def test_python_verifier(tmp_path: Path) -> None:
    task = Task.model_validate(
        {**GOOD, "verifier": {"python": tools_tiny.VERIFIER, "kwargs": {"expected": "7"}}}
    )
    assert verify_local(task, tmp_path).details["error"] == "answer.txt is missing"
    (tmp_path / "answer.txt").write_text(" 7\n")
    assert verify_local(task, tmp_path).reward == 1.0
    broken = Task.model_validate({**GOOD, "verifier": {"python": "openforgerl.no_such_module:f"}})
    with pytest.raises(VerifierError, match="no_such_module"):
        verify_local(broken, tmp_path)


# -- tools-tiny ---------------------------------------------------------------------------------


def test_tools_tiny_is_deterministic_with_disjoint_splits() -> None:
    tasks = load_tasks("tools-tiny")
    assert tasks == tools_tiny.generate(seed=0) and tasks != tools_tiny.generate(seed=1)
    train, heldout = load_tasks("tools-tiny", "train"), load_tasks("tools-tiny", "heldout")
    assert (len(train), len(heldout)) == (1000, 50)
    assert len({t.id for t in tasks}) == 1050

    def content(t: Task) -> tuple[object, ...]:
        assert isinstance(t.files, dict)
        return (t.instruction, *sorted(t.files.items()))

    assert not {content(t) for t in train} & {content(t) for t in heldout}
    assert {t.metadata["family"] for t in heldout} == set(tools_tiny.FAMILIES)
    assert max(len(t.instruction) for t in tasks) <= 80


def test_the_oracle_solves_every_tools_tiny_task(tmp_path: Path) -> None:
    for i, task in enumerate(tools_tiny.generate(seed=3, n_train=40, n_heldout=20)):
        solution = tools_tiny.oracle(task)
        assert len(solution.calls) == len(task.metadata["inputs"]) + 1 >= 2
        assert solution.final_answer == task.verifier.kwargs["expected"]  # type: ignore[union-attr]
        # The written-out computation starts from the files' values and ends in the answer.
        values = [task.files[n].strip() for n in task.metadata["inputs"]]  # type: ignore[index]
        assert solution.working.rstrip('"').endswith(solution.final_answer)
        assert solution.working.removeprefix("max(").replace('"', "").split()[0].rstrip(",") == values[0]
        work = tmp_path / str(i)
        prepare_local(task, work)
        assert verify_local(task, work).reward == 0.0
        for call in solution.calls:  # play the calls as the harness's tools would
            assert call.name in {"read_file", "write_file"}
            if call.name == "read_file":
                assert (work / call.arguments["path"]).is_file()
            else:
                (work / call.arguments["path"]).write_text(call.arguments["content"])
        assert verify_local(task, work).reward == 1.0


def test_sums_and_differences_are_worked_out_one_step_at_a_time() -> None:
    """Every step of an add/sub working is one more and one less (or both one less) than the
    step before, and true: a student that learns the step can work out pairs it never saw."""
    tasks = tools_tiny.generate(seed=5, n_train=70, n_heldout=0)
    counted = [t for t in tasks if t.metadata["family"] in ("add", "sub")]
    assert len(counted) >= 15
    for task in counted:
        sign = "+" if task.metadata["family"] == "add" else "-"
        *steps, answer = tools_tiny.oracle(task).working.split(" = ")
        pairs = [tuple(int(x) for x in step.split(f" {sign} ")) for step in steps]
        values = tuple(int(task.files[n]) for n in task.metadata["inputs"])  # type: ignore[index]
        assert pairs[0] == values and pairs[-1][1] == 0 and str(pairs[-1][0]) == answer
        for (a, b), (a2, b2) in itertools.pairwise(pairs):
            assert (a2, b2) == ((a + 1 if sign == "+" else a - 1), b - 1)
        assert all((a + b if sign == "+" else a - b) == int(answer) for a, b in pairs)


# -- tools-tiny-reworded ------------------------------------------------------------------------


def test_tools_tiny_reworded_is_held_out_and_deterministic_and_repeats_no_tools_tiny_task() -> None:
    tasks = load_tasks("tools-tiny-reworded", "heldout")
    assert tasks == load_tasks("tools-tiny-reworded") == tools_tiny_reworded.generate()
    assert tasks != tools_tiny_reworded.generate(seed=tools_tiny_reworded.SEED + 1)
    assert tools_tiny_reworded.SEED != tools_tiny.generate()[0].metadata["seed"]
    assert len(tasks) == 70 and len({t.id for t in tasks}) == 70
    assert not load_tasks("tools-tiny-reworded", "train")  # evaluated only, never trained on
    keys = [tools_tiny_reworded.task_key(t) for t in tasks]
    assert len(set(keys)) == 70
    for split in ("train", "heldout"):  # not a tools-tiny task in other words
        assert not set(keys) & {tools_tiny_reworded.task_key(t) for t in load_tasks("tools-tiny", split)}
    original = {f.instruction for f in tools_tiny.FAMILIES.values()}
    for family in tools_tiny.FAMILIES:
        mine = [t for t in tasks if t.metadata["family"] == family]
        assert len(mine) == 10 and all(t.tags == ["tools-tiny-reworded", family] for t in mine)
        used = {t.metadata["template"] for t in mine}
        assert len(used) >= 2 and used == set(range(len(tools_tiny_reworded.TEMPLATES[family])))
        for template in tools_tiny_reworded.TEMPLATES[family]:  # other words, not tools-tiny's
            assert template not in original and not template.startswith("Read ")
    # Every input file is named in the instruction, once.
    for t in tasks:
        assert all(t.instruction.count(n) == 1 for n in t.metadata["inputs"]), t.instruction


def test_the_oracle_solves_every_tools_tiny_reworded_task(tmp_path: Path) -> None:
    for i, task in enumerate(load_tasks("tools-tiny-reworded")):
        solution = tools_tiny.oracle(task)
        assert solution.final_answer == task.verifier.kwargs["expected"]  # type: ignore[union-attr]
        work = tmp_path / str(i)
        prepare_local(task, work)
        assert verify_local(task, work).reward == 0.0
        for call in solution.calls:  # play the calls as the harness's tools would
            if call.name == "read_file":
                assert (work / call.arguments["path"]).is_file()
            else:
                (work / call.arguments["path"]).write_text(call.arguments["content"])
        assert verify_local(task, work).reward == 1.0


# -- tools-tiny-varied ---------------------------------------------------------------------------


def _words(sentence: str) -> list[str]:
    """The sentence's words without its file names (any list of files reads alike)."""
    return re.sub(r"\{f\d\}('s)?", "", sentence).replace(",", "").split()


def test_tools_tiny_varied_asks_the_train_tasks_in_turns_and_never_in_the_reworded_sets_words() -> None:
    varied, plain = load_tasks("tools-tiny-varied"), load_tasks("tools-tiny")
    assert varied == tools_tiny_varied.generate()
    # The same tasks (ids, files, answers), held-out ones exactly tools-tiny's.
    assert [(t.id, t.files, t.verifier) for t in varied] == [(t.id, t.files, t.verifier) for t in plain]
    assert load_tasks("tools-tiny-varied", "heldout") == load_tasks("tools-tiny", "heldout")
    for family, paraphrases in tools_tiny_varied.PARAPHRASES.items():
        mine = [(v, p) for v, p in zip(varied, plain, strict=True) if v.metadata["family"] == family]
        train = [(v, p) for v, p in mine if v.split == "train"]
        # tools-tiny's sentence, then each paraphrase, in turn.
        turns = [v.metadata.get("wording", 0) for v, _ in train[:8]]
        assert turns == [0, 1, 2, 3, 0, 1, 2, 3], family
        for v, p in train[:4]:
            assert (v.instruction == p.instruction) == (v.metadata.get("wording", 0) == 0)
            assert all(v.instruction.count(n) == 1 for n in v.metadata["inputs"]), v.instruction
        # Never one of the held-out reworded sentences, nor 5 of its words in a row (file names aside).
        for sentence in paraphrases:
            words = _words(sentence)
            runs = {tuple(words[i : i + 5]) for i in range(len(words) - 4)}
            for held_out in tools_tiny_reworded.TEMPLATES[family]:
                other = _words(held_out)
                assert sentence != held_out
                assert not runs & {tuple(other[i : i + 5]) for i in range(len(other) - 4)}, sentence


def test_oracle_call_text_is_the_chat_template_format() -> None:
    task = load_tasks("tools-tiny")[0]
    first = tools_tiny.oracle(task).calls[0]
    path = task.metadata["inputs"][0]
    assert (
        first.text()
        == f'<tool_call>\n{{"name": "read_file", "arguments": {{"path": "{path}"}}}}\n</tool_call>'
    )
