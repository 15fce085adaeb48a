"""Harbor task folders (#26): loaded as a Harbor user writes them, checked with `openforge tasks check`,
run through `openforge eval`. Every folder here is made by the test; the Docker runs of the Dockerfile
environment are in test_docker.py."""

from __future__ import annotations

import json
import re
import shutil
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from openforgerl.cli import main as cli
from openforgerl.eval_options import EvalOptions
from openforgerl.evaluate import run_eval
from openforgerl.sandbox import SandboxUnavailable
from openforgerl.sandbox.local import LocalBackend
from openforgerl.tasks import CommandVerifier, TaskError, load_tasks
from openforgerl.tasks.harbor import REWARD_FILES
from tests.gateway_helpers import ScriptEngine
from tests.harbor_helpers import REWARD_TXT, SOLVE_42, harbor_task

UTF16 = "id,name\n1,Jürgen\n".encode("utf-16")


def make_task_set(root: Path) -> Path:
    """The shapes a Harbor task set has: reward.txt, reward.json, partial rewards, a Dockerfile
    environment, an image, host tools with a workspace, a failing solution, and Terminal-Bench 1."""
    harbor_task(
        root,
        "txt-reward",
        test_sh=REWARD_TXT,
        solve_sh=SOLVE_42,
        metadata='split = "train"',
        environment="cpus = 2\nmemory_mb = 1536\nallow_internet = false",
    )
    harbor_task(
        root,
        "json-reward",
        test_sh="""\
            #!/bin/bash
            got=$(cat /app/out.txt 2>/dev/null)
            r=0; [ "$got" = "$EXPECTED" ] && r=1
            echo "{\\"reward\\": $r, \\"got\\": \\"$got\\"}" > /logs/verifier/reward.json
        """,
        solve_sh="#!/bin/bash\nprintf done > /app/out.txt\n",
        verifier='env = { EXPECTED = "done" }',
    )
    # Partial rewards on a UTF-16 workspace: half for a UTF-8 copy, half for the original untouched.
    harbor_task(
        root,
        "partial",
        test_sh="""\
            #!/bin/bash
            r=0
            [ "$(cat /app/names-utf8.csv 2>/dev/null)" = "$(printf 'id,name\\n1,J\\303\\274rgen')" ] && r=0.5
            bom=$(head -c 2 /app/names.csv | od -An -tx1 | tr -d ' ')
            [ "$bom" = fffe ] && r=$(awk "BEGIN {print $r + 0.5}")
            echo $r > /logs/verifier/reward.txt
        """,
        solve_sh="#!/bin/bash\niconv -f UTF-16 -t UTF-8 /app/names.csv > /app/names-utf8.csv\n",
        workspace={"names.csv": UTF16},
    )
    harbor_task(
        root,
        "dockerfile-env",
        test_sh=REWARD_TXT,
        solve_sh=SOLVE_42,
        dockerfile="FROM debian:bookworm-slim\nWORKDIR /app\nCOPY seed.txt /app/seed.txt\n",
        workspace={"seed.txt": b"seed\n"},
    )
    harbor_task(
        root,
        "image-env",
        test_sh=REWARD_TXT,
        solve_sh=SOLVE_42,
        environment='docker_image = "python:3.12-slim"',
    )
    harbor_task(
        root, "failing-solution", test_sh=REWARD_TXT, solve_sh="#!/bin/bash\necho 41 > /app/answer.txt\n"
    )
    tb1 = root / "tb1-task"
    (tb1 / "tests").mkdir(parents=True)
    (tb1 / "task.yaml").write_text(
        "instruction: |\n  Write 42 to /app/answer.txt.\nmax_agent_timeout_sec: 100\n"
    )
    (tb1 / "tests" / "expected.txt").write_text("42\n")
    (tb1 / "run-tests.sh").write_text('#!/bin/bash\ncmp /app/answer.txt "$TEST_DIR/expected.txt"\n')
    (tb1 / "solution.sh").write_text(SOLVE_42)
    return root


def test_every_shape_loads_as_a_harbor_user_expects(tmp_path: Path) -> None:
    root = make_task_set(tmp_path / "set")
    tasks = {t.id: t for t in load_tasks(f"harbor:{root}")}
    assert [t.id for t in load_tasks(root)] == sorted(tasks)  # found by itself too
    assert sorted(tasks) == [
        "dockerfile-env",
        "failing-solution",
        "image-env",
        "json-reward",
        "partial",
        "tb1-task",
        "txt-reward",
    ]
    txt = tasks["txt-reward"]
    assert (txt.split, txt.workdir, txt.timeout, txt.offline, txt.needs_image) == (
        "train",
        "/app",
        120.0,
        True,
        False,
    )
    assert (txt.resources.cpus, int(txt.resources.memory or 0)) == (2, 1536 << 20)
    assert isinstance(txt.verifier, CommandVerifier)
    assert (txt.verifier.command, txt.verifier.at, txt.verifier.timeout) == (
        "bash /tests/test.sh",
        "/tests",
        30.0,
    )
    assert txt.verifier.reward_files == REWARD_FILES
    assert txt.solution is not None and (txt.solution.command, txt.solution.at) == (
        "bash /solution/solve.sh",
        "/solution",
    )
    assert txt.inside_dirs() == ["/logs/verifier", "/solution", "/tests"]
    assert tasks["json-reward"].split == "test" and tasks["json-reward"].verifier.env == {"EXPECTED": "done"}
    assert tasks["partial"].files == root / "partial" / "environment"  # the host-tools task's /app
    docker = tasks["dockerfile-env"]
    assert docker.needs_image and docker.build == root / "dockerfile-env" / "environment"
    assert re.fullmatch(r"openforge-task-dockerfile-env:[0-9a-f]{12}", docker.image or "")
    assert docker.files == {}  # its environment/ is a build context, not the workspace
    image = tasks["image-env"]
    assert (image.needs_image, image.image, image.build) == (True, "python:3.12-slim", None)
    assert (tasks["tb1-task"].timeout, tasks["tb1-task"].needs_image) == (100.0, False)
    assert load_tasks(root, split="train") == [txt]


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[agent\ntimeout_sec = 1", r"task\.toml: not valid TOML"),
        (
            '[agent]\ntimeout_sec = "soon"',
            r"task\.toml: \[agent\] timeout_sec: Input should be a valid number",
        ),
        (
            "[environment]\ncpus = -1",
            r"task\.toml: \[environment\] cpus: Input should be greater than or equal to 0\.01",
        ),
        ('[metadata]\nsplit = "later"', r"task\.toml: task 'bad': split: Input should be 'train', 'heldout'"),
        # Absurd settings (#35): refused here, naming the field, not failed as infrastructure mid-run.
        ("[environment]\ncpus = 1e9", r"\[environment\] cpus: Input should be less than or equal to 1024"),
        (
            "[environment]\nmemory_mb = 1",
            r"\[environment\] memory_mb: Input should be greater than or equal to 16",
        ),
        (
            "[environment]\nmemory_mb = 1e12",
            r"\[environment\] memory_mb: Input should be less than or equal to 1048576",
        ),
        (
            '[environment]\nmemory = "lots"',
            r"task\.toml: \[environment\] memory: could not parse value and unit",
        ),
        (
            '[environment]\nmemory = "1K"',
            r"\[environment\] memory: Value error, memory must be from 16MiB to 1TiB",
        ),
        ("[agent]\ntimeout_sec = inf", r"task\.toml: \[agent\] timeout_sec: Input should be a finite number"),
        ("[verifier]\ntimeout_sec = nan", r"\[verifier\] timeout_sec: Input should be a finite number"),
        ("[agent]\ntimeout_sec = 0", r"\[agent\] timeout_sec: Input should be greater than 0"),
        (
            "[agent]\ntimeout_sec = 1e9",
            r"\[agent\] timeout_sec: Input should be less than or equal to 604800",
        ),
    ],
)
def test_a_malformed_task_toml_is_named_with_its_field(tmp_path: Path, toml: str, message: str) -> None:
    folder = harbor_task(tmp_path, "bad", test_sh=REWARD_TXT, solve_sh=SOLVE_42)
    (folder / "task.toml").write_text(toml)
    with pytest.raises(TaskError, match=message):
        load_tasks(f"harbor:{tmp_path}")


CANARY = "CANARY-7f3e secret runner key"


def outside(tmp_path: Path) -> tuple[Path, Path]:
    """A secret file and a folder of secrets outside every task folder."""
    secret = tmp_path / "secret.txt"
    secret.write_text(CANARY + "\n")
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "test.sh").write_text(f"echo {CANARY}\n")
    return secret, tmp_path / "secrets"


def link_out(link: Path, target: Path | str) -> None:
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)
    link.unlink(missing_ok=True)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)


@pytest.mark.parametrize(
    "rel",
    [
        "instruction.md",
        "task.toml",
        "tests/test.sh",
        "tests/data.txt",
        "tests",
        "solution/solve.sh",
        "solution",
        "environment/seed.txt",
        "environment",
        "environment/Dockerfile",
        "notes/anything.txt",  # read or not, nothing in a task folder leads out of it
    ],
)
def test_a_harbor_file_linked_out_of_its_folder_is_refused_at_load(tmp_path: Path, rel: str) -> None:
    """#35: instruction.md -> /etc/shadow went into the prompt; a test.sh link out was a traceback."""
    secret, secrets = outside(tmp_path)
    root = tmp_path / "set"
    harbor_task(root, "fine", test_sh=REWARD_TXT, solve_sh=SOLVE_42)
    folder = harbor_task(root, "leaky", test_sh=REWARD_TXT, solve_sh=SOLVE_42, workspace={"seed.txt": b"s\n"})
    target = secrets if rel in ("tests", "solution", "environment") else secret
    link_out(folder / rel, target)
    with pytest.raises(TaskError) as info:
        load_tasks(f"harbor:{root}")
    message = str(info.value)
    assert message == (
        f"{folder / rel}: a symlink to {str(target)!r}, outside the task folder {folder}: refused (a task's "
        "files are read only from inside its folder)"
    )
    assert CANARY not in message


def test_a_link_out_through_another_link_is_refused_too(tmp_path: Path) -> None:
    """`d/up -> ..` stays inside, but `instruction.md -> d/up/../../secret.txt` does not, though its
    text alone looks as if it did."""
    outside(tmp_path)
    root = tmp_path / "set"
    folder = harbor_task(root, "leaky", test_sh=REWARD_TXT, solve_sh=SOLVE_42)
    (folder / "d").mkdir()
    (folder / "d" / "up").symlink_to("..")
    link_out(folder / "instruction.md", "d/up/../../secret.txt")
    assert CANARY in (folder / "instruction.md").read_text()  # the link does lead to the secret
    with pytest.raises(
        TaskError, match=r"instruction\.md: a symlink to 'd/up/\.\./\.\./secret\.txt', outside"
    ):
        load_tasks(root)


def test_links_that_stay_inside_the_folder_keep_working(tmp_path: Path) -> None:
    root = tmp_path / "set"
    folder = harbor_task(
        root, "linked", test_sh=REWARD_TXT, solve_sh=SOLVE_42, workspace={"seed.txt": b"s\n"}
    )
    (folder / "docs").mkdir()
    (folder / "docs" / "prompt.md").write_text("Write 42 to /app/answer.txt.\n")
    link_out(folder / "instruction.md", "docs/prompt.md")
    (folder / "tests" / "run.sh").symlink_to("test.sh")
    (folder / "environment" / "latest.txt").symlink_to("seed.txt")
    (task,) = load_tasks(root)
    assert task.instruction == "Write 42 to /app/answer.txt."
    assert task.files == folder / "environment"


@pytest.mark.parametrize(
    "rel", ["task.yaml", "run-tests.sh", "solution.sh", "Dockerfile", "tests/expected.txt", "tests"]
)
def test_a_terminal_bench_file_linked_out_of_its_folder_is_refused_at_load(tmp_path: Path, rel: str) -> None:
    """#35: Terminal-Bench 1's run-tests.sh and solution.sh were read wherever they pointed, into the
    verifier's and the solution's commands."""
    secret, secrets = outside(tmp_path)
    root = make_task_set(tmp_path / "set")
    folder = root / "tb1-task"
    target = secrets if rel == "tests" else secret
    link_out(folder / rel, target)
    with pytest.raises(TaskError) as info:
        load_tasks(f"terminal-bench:{root}")
    message = str(info.value)
    assert message.startswith(
        f"{folder / rel}: a symlink to {str(target)!r}, outside the task folder {folder}"
    )
    assert CANARY not in message and len(message.splitlines()) == 1


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        (
            "instruction: x\nmax_agent_timeout_sec: .inf\n",
            r"max_agent_timeout_sec: Input should be a finite number",
        ),
        (
            "instruction: x\nmax_test_timeout_sec: -5\n",
            r"max_test_timeout_sec: Input should be greater than 0",
        ),
        (
            "instruction: x\nmax_agent_timeout_sec: soon\n",
            r"max_agent_timeout_sec: Input should be a valid number",
        ),
    ],
)
def test_terminal_bench_timeouts_are_checked_by_their_names(
    tmp_path: Path, yaml_text: str, message: str
) -> None:
    root = make_task_set(tmp_path / "set")
    (root / "tb1-task" / "task.yaml").write_text(yaml_text)
    with pytest.raises(TaskError, match=rf"tb1-task/task\.yaml: {message}"):
        load_tasks(root)


def test_an_unreadable_task_file_is_named_not_a_traceback(tmp_path: Path) -> None:
    root = make_task_set(tmp_path / "set")
    (root / "txt-reward" / "instruction.md").write_bytes(b"\xff\xfe not UTF-8 \x80")
    (root / "tb1-task" / "run-tests.sh").write_bytes(b"\x80\x81")
    with pytest.raises(TaskError) as info:
        load_tasks(root)
    first, second = str(info.value).splitlines()
    assert first.startswith(f"{root}/tb1-task/run-tests.sh: not UTF-8 text: ")
    assert second.startswith(f"{root}/txt-reward/instruction.md: not UTF-8 text: ")


def test_every_invalid_task_folder_is_one_clean_error_line(tmp_path: Path) -> None:
    """#35: `memory = "lots"` was a raw traceback; each bad folder is one line, exit status 1."""
    secret, _ = outside(tmp_path)
    root = make_task_set(tmp_path / "set")
    (root / "image-env" / "task.toml").write_text('[environment]\nmemory = "lots"\n')
    (root / "json-reward" / "task.toml").write_text("[agent]\ntimeout_sec = inf\n[environment]\ncpus = 1e9\n")
    (root / "tb1-task" / "task.yaml").write_text("instruction: [unclosed\n")  # YAML's error spans lines
    link_out(root / "partial" / "instruction.md", secret)
    args = ["--tasks", str(root), "--gateway", "http://127.0.0.1:9", "--out", str(tmp_path / "o")]
    for command in (["eval", *args], ["rollout", *args], ["tasks", "check", str(root)]):
        result = CliRunner().invoke(cli, command)
        assert result.exit_code == 1, (command, result.output)
        assert isinstance(result.exception, SystemExit), (command, result.exception)  # not a traceback
        lines = result.output.splitlines()
        assert len(lines) == 4, (command, result.output)
        assert lines[0].startswith(f"Error: {root}/image-env/task.toml: [environment] memory: ")
        assert lines[1].startswith(
            f"{root}/json-reward/task.toml: [agent] timeout_sec: Input should be a finite"
        )
        assert "[environment] cpus: Input should be less than or equal to 1024" in lines[1]
        assert lines[2].startswith(f"{root}/partial/instruction.md: a symlink to {str(secret)!r}, outside")
        assert lines[3].startswith(f"{root}/tb1-task/task.yaml: not valid YAML: ")
        assert CANARY not in result.output and "Traceback" not in result.output


def test_missing_files_are_named(tmp_path: Path) -> None:
    harbor_task(tmp_path, "a", test_sh=REWARD_TXT, solve_sh=None)
    (tmp_path / "a" / "instruction.md").unlink()
    harbor_task(tmp_path, "b", test_sh=REWARD_TXT, solve_sh=None)
    (tmp_path / "b" / "tests" / "test.sh").unlink()
    with pytest.raises(TaskError) as info:
        load_tasks(tmp_path)
    assert f"{tmp_path}/a/instruction.md: missing" in str(info.value)
    assert f"{tmp_path}/b/tests/test.sh: missing" in str(info.value)


def test_tasks_check_says_which_tasks_are_sound(tmp_path: Path) -> None:
    try:
        LocalBackend(bwrap=True)
    except SandboxUnavailable as e:
        pytest.skip(f"bubblewrap unusable here ({e}); Harbor tasks need it for /app")
    root = make_task_set(tmp_path / "set")
    # A verifier that leaves a trace in the workspace, and one that passes whatever the agent did.
    harbor_task(
        root,
        "dirty-verifier",
        test_sh=REWARD_TXT.replace("#!/bin/bash", "touch /app/.seen"),
        solve_sh=SOLVE_42,
    )
    harbor_task(root, "always-passes", test_sh="echo 1 > /logs/verifier/reward.txt", solve_sh=SOLVE_42)
    harbor_task(root, "no-solution", test_sh=REWARD_TXT, solve_sh=None)
    result = CliRunner().invoke(cli, ["tasks", "check", str(root), "--concurrency", "2"])
    lines = {line.split()[1]: line for line in result.output.splitlines() if line.startswith(("ok", "FAIL"))}
    assert result.exit_code == 1, result.output
    for ok in ("txt-reward", "json-reward", "tb1-task"):
        assert re.match(rf"ok   {ok} \(untouched 0\.00; solved 1\.00, 1\.00\)", lines[ok]), lines[ok]
    assert lines["partial"].startswith("ok   partial (untouched 0.50; solved 1.00, 1.00)")
    assert re.search(
        r"FAIL dockerfile-env .*runs only in its image openforge-task-dockerfile-env:\w+, built from "
        rf"{root}/dockerfile-env/environment/Dockerfile: check it with --backend docker",
        lines["dockerfile-env"],
    )
    assert "runs only in its image python:3.12-slim" in lines["image-env"]
    assert re.search(
        r"FAIL failing-solution \(untouched 0\.00; solved 0\.00\).*scored 0\.00", lines["failing-solution"]
    )
    assert "changed the workspace: .seen" in lines["dirty-verifier"]
    assert "passes the untouched workspace" in lines["always-passes"]
    assert "no reference solution" in lines["no-solution"]
    assert result.output.splitlines()[-1].startswith("10 task(s): 4 passed, 6 failed")


def test_a_sound_task_set_exits_zero(tmp_path: Path) -> None:
    root = tmp_path / "set"
    harbor_task(root, "one", test_sh=REWARD_TXT, solve_sh=SOLVE_42)
    result = CliRunner().invoke(cli, ["tasks", "check", f"harbor:{root}"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == "1 task(s): 1 passed, 0 failed"


def solver(engine: ScriptEngine, solutions: dict[str, str]) -> None:
    """A SCRIPTED policy: runs the task's reference solution through the bash tool, then submits."""

    def step(prompt: list[int]) -> str:
        text = engine.tokenizer.decode(prompt)
        if "<tool_response>" in text:
            return '<tool_call>\n{"name": "submit", "arguments": {"answer": "done"}}\n</tool_call>'
        script = next(s for name, s in solutions.items() if f"Solve {name} in /app." in text)
        call = {"name": "bash", "arguments": {"command": script}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"

    engine.script = step


def test_eval_runs_harbor_tasks_with_their_rewards(tiny_model_dir: Path, tmp_path: Path) -> None:
    root = make_task_set(tmp_path / "set")
    for name in ("dockerfile-env", "image-env", "tb1-task"):  # refused on local / not scripted here
        for path in sorted((root / name).rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        (root / name).rmdir()
    engine = ScriptEngine(tiny_model_dir)
    solutions = {p.parent.parent.name: p.read_text() for p in root.glob("*/solution/solve.sh")}
    solver(engine, solutions)
    opts = EvalOptions(
        tasks=f"harbor:{root}", model=str(tiny_model_dir), out=tmp_path / "eval", progress=False
    )
    report = run_eval(opts, engine)
    rewards = {t["task_id"]: t["mean_reward"] for t in report["summary"]["per_task"]}
    assert rewards == {"failing-solution": 0.0, "json-reward": 1.0, "partial": 1.0, "txt-reward": 1.0}


def test_eval_refuses_tasks_bound_to_their_image_before_loading_a_model(tmp_path: Path) -> None:
    root = make_task_set(tmp_path / "set")
    result = CliRunner().invoke(
        cli,
        [
            "eval",
            "--tasks",
            f"harbor:{root}",
            "--gateway",
            "http://127.0.0.1:9",
            "--out",
            str(tmp_path / "o"),
        ],
    )
    assert result.exit_code == 1
    assert "2 task(s) need their own container image" in result.output
    assert "task 'dockerfile-env' runs only in its image openforge-task-dockerfile-env:" in result.output
    assert "task 'image-env' runs only in its image python:3.12-slim" in result.output


def test_allow_internet_false_keeps_the_sandbox_off_the_host_network(tmp_path: Path) -> None:
    from openforgerl.rollouts.steps import task_spec
    from openforgerl.sandbox import Limits

    root = make_task_set(tmp_path / "set")
    tasks = {t.id: t for t in load_tasks(root)}
    offline, allowed = tasks["txt-reward"], tasks["json-reward"]
    url = "http://127.0.0.1:8000"
    assert task_spec(offline, limits=Limits(), network="host", gateway_url=url).network == "gateway"
    assert task_spec(allowed, limits=Limits(), network="host", gateway_url=url).network == "host"
    spec = task_spec(offline, limits=Limits(), network="gateway", gateway_url=url)
    assert (spec.workdir, spec.extra_dirs, spec.limits.cpus) == (
        "/app",
        ["/logs/verifier", "/solution", "/tests"],
        2,
    )


def test_a_yaml_task_with_a_reference_solution_is_checked_too(tmp_path: Path) -> None:
    """tasks check is not Harbor's alone: a task file's `solution` (files outside the work dir)."""
    (tmp_path / "solutions").mkdir()
    (tmp_path / "solutions" / "fix.sh").write_text("sed -i s/bug/fixed/ code.txt\n")
    (tmp_path / "tasks.yaml").write_text(
        textwrap.dedent("""\
            id: fix-it
            instruction: Replace bug by fixed in code.txt.
            split: test
            files: {code.txt: "bug\\n"}
            solution: {command: 'sh "$OPENFORGE_SOLUTION_DIR/fix.sh"', files: solutions}
            verifier: {command: 'grep -qx fixed code.txt'}
        """)
    )
    result = CliRunner().invoke(cli, ["tasks", "check", str(tmp_path / "tasks.yaml")])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("ok   fix-it (untouched 0.00; solved 1.00, 1.00)"), result.output
