"""The claw-basic verifier: `python3 checks.py TASK_ID`, run in the task's final work directory.

It judges the resulting state of the work directory, never the transcript, and prints
`{"reward": 1.0 | 0.0, "passed": [...], "failed": [...]}`. The reward is all-or-nothing so that
doing the easy half of a task is not rewarded; `passed`/`failed` say what went wrong. Standard
library only: it runs inside the task's sandbox, next to `expected/` (reference files).
"""

from __future__ import annotations

import configparser
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

EXPECTED = Path(__file__).parent / "expected"


class Check:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.passed: list[str] = []
        self.failed: list[str] = []

    def ok(self, condition: bool, what: str) -> bool:
        (self.passed if condition else self.failed).append(what)
        return condition

    def text(self, rel: str) -> str | None:
        path = self.workdir / rel
        if not self.ok(path.is_file(), f"{rel} exists"):
            return None
        return path.read_text(encoding="utf-8", errors="replace")

    def lines(self, rel: str) -> list[str] | None:
        text = self.text(rel)
        return None if text is None else [line.rstrip() for line in text.strip().splitlines()]

    def json(self, rel: str) -> Any:
        text = self.text(rel)
        if text is None:
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            self.ok(False, f"{rel} is valid JSON")
            return None

    def csv(self, rel: str) -> list[list[str]] | None:
        text = self.text(rel)
        return None if text is None else [row for row in csv.reader(text.splitlines()) if row]

    def run(self, argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str] | None:
        try:
            return subprocess.run(
                argv, cwd=cwd or self.workdir, capture_output=True, text=True, timeout=30, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            self.ok(False, f"{' '.join(argv)} runs ({exc})")
            return None

    def same_text(self, rel: str, expected: str) -> None:
        text = self.text(rel)
        if text is not None:
            self.ok(text.rstrip() == expected.rstrip(), f"{rel} has the expected content")

    def files(self, rel: str) -> dict[str, str]:
        """Every file under a folder: relative path -> text."""
        root = self.workdir / rel
        return {
            p.relative_to(root).as_posix(): p.read_text(encoding="utf-8", errors="replace")
            for p in sorted(root.rglob("*"))
            if p.is_file()
        }


CHECKS: dict[str, Callable[[Check], None]] = {}


def check(task_id: str) -> Callable[[Callable[[Check], None]], Callable[[Check], None]]:
    def register(fn: Callable[[Check], None]) -> Callable[[Check], None]:
        CHECKS[task_id] = fn
        return fn

    return register


def _answer(c: Check, rel: str, expected: str) -> None:
    text = c.text(rel)
    if text is not None:
        c.ok(text.strip() == expected, f"{rel} holds {expected}")


def _python_prints(c: Check, code: str, expected: str) -> None:
    done = c.run([sys.executable, "-c", code])
    if done is not None:
        c.ok(done.returncode == 0 and done.stdout.strip() == expected, f"{code!r} prints {expected!r}")


@check("fix-typo-readme")
def _fix_typo_readme(c: Check) -> None:
    c.same_text("README.md", (EXPECTED / "fix-typo-readme" / "README.md").read_text())


@check("create-hello-script")
def _create_hello_script(c: Check) -> None:
    if c.text("hello.py") is not None:
        done = c.run([sys.executable, "hello.py"])
        c.ok(done is not None and done.stdout == "Hello, OpenForge!\n", "hello.py prints the greeting")


@check("count-error-lines")
def _count_error_lines(c: Check) -> None:
    _answer(c, "error_count.txt", "6")


@check("failed-request-ids")
def _failed_request_ids(c: Check) -> None:
    c.ok(c.lines("failed.txt") == ["r-1002", "r-1004", "r-1007", "r-1010"], "failed.txt lists the ids")


@check("status-counts")
def _status_counts(c: Check) -> None:
    expected = {"200": 3, "201": 1, "404": 1, "499": 1, "500": 3, "502": 1, "503": 1}
    c.ok(c.json("status_counts.json") == expected, "status_counts.json has the counts")


@check("fix-mean-script")
def _fix_mean_script(c: Check) -> None:
    for data, mean in (("numbers.txt", "18.00"), (str(EXPECTED / "fix-mean-script" / "hidden.txt"), "4.67")):
        done = c.run([sys.executable, "stats.py", data])
        printed = done.stdout.strip() if done is not None else None
        c.ok(printed == mean, f"stats.py prints {mean} for {Path(data).name}")


@check("csv-to-json")
def _csv_to_json(c: Check) -> None:
    expected = [
        {"name": "Alice", "age": 34, "city": "Lisbon"},
        {"name": "Bob", "age": 27, "city": "Oslo"},
        {"name": "Chen", "age": 45, "city": "Taipei"},
        {"name": "Dana", "age": 31, "city": "Nairobi"},
        {"name": "Emil", "age": 29, "city": "Berlin"},
    ]
    c.ok(c.json("people.json") == expected, "people.json holds the rows with numeric ages")


@check("json-to-csv")
def _json_to_csv(c: Check) -> None:
    expected = [
        ["sku", "name", "qty"],
        ["A-100", "bolt", "250"],
        ["A-101", "nut", "400"],
        ["B-200", "washer", "0"],
        ["C-310", "hinge, steel", "12"],
    ]
    c.ok(c.csv("inventory.csv") == expected, "inventory.csv holds the items")


@check("rename-jpeg")
def _rename_jpeg(c: Check) -> None:
    files = c.files("photos")
    expected = {f"{n}.jpg": f"fake image data: {n}\n" for n in ("beach", "cat", "mountain")}
    expected |= {"logo.png": "fake image data: logo\n", "notes.txt": "Photos from the spring trip.\n"}
    c.ok(files == expected, "photos/ holds .jpg files with their contents and the untouched others")


@check("lowercase-filenames")
def _lowercase_filenames(c: Check) -> None:
    expected = {n.lower(): f"contents of {n}\n" for n in ("README.TXT", "Notes.md", "TODO.Txt", "guide.md")}
    c.ok(c.files("docs") == expected, "docs/ holds the same files under lowercase names")


@check("count-python-lines")
def _count_python_lines(c: Check) -> None:
    _answer(c, "loc.txt", "23")


@check("fix-json-config")
def _fix_json_config(c: Check) -> None:
    expected = {
        "service": "billing",
        "port": 8080,
        "debug": False,
        "database": {"host": "db.internal", "port": 5432},
        "workers": 4,
    }
    c.ok(c.json("config.json") == expected, "config.json parses to the same settings")


@check("ini-change-port")
def _ini_change_port(c: Check) -> None:
    text = c.text("settings.ini")
    if text is None:
        return
    parser = configparser.ConfigParser()
    try:
        parser.read_string(text)
    except configparser.Error:
        c.ok(False, "settings.ini parses")
        return
    got = {s: dict(parser[s]) for s in parser.sections()}
    expected = {
        "server": {"host": "0.0.0.0", "port": "9090", "workers": "4"},
        "metrics": {"enabled": "true", "port": "9100"},
    }
    c.ok(got == expected, "only the server port changed to 9090")


@check("top-words")
def _top_words(c: Check) -> None:
    c.ok(c.lines("top3.txt") == ["apple", "banana", "cherry"], "top3.txt lists the three words in order")


@check("join-csv")
def _join_csv(c: Check) -> None:
    expected = [["name", "total"], ["ana", "7.50"], ["ben", "27.00"], ["cleo", "12.50"], ["dev", "0.00"]]
    c.ok(c.csv("totals.csv") == expected, "totals.csv holds the totals per user")


@check("replace-domain")
def _replace_domain(c: Check) -> None:
    expected = Check(EXPECTED / "replace-domain").files("site")
    c.ok(c.files("site") == expected, "every file under site/ has the new domain and nothing else changed")


@check("scaffold-package")
def _scaffold_package(c: Check) -> None:
    code = "import mylib, mylib.core; print(mylib.__version__, mylib.core.greet('Ada'))"
    _python_prints(c, code, "0.1.0 Hello, Ada!")
    lines = c.lines("README.md")
    c.ok(lines is not None and lines[:1] == ["# mylib"], "README.md starts with '# mylib'")


@check("clean-tmp-files")
def _clean_tmp_files(c: Check) -> None:
    remaining = set(c.files("build"))
    c.ok(remaining == {"app.o", "report.tmp.txt", "sub/keep.txt"}, "only the .tmp files are gone")


@check("sort-downloads")
def _sort_downloads(c: Check) -> None:
    moved = {
        "docs/report.pdf": "report.pdf",
        "docs/invoice.PDF": "invoice.PDF",
        "images/photo.png": "photo.png",
        "images/scan.jpg": "scan.jpg",
        "notes.txt": "notes.txt",
        "archive.zip": "archive.zip",
    }
    expected = {rel: f"contents of {name}\n" for rel, name in moved.items()}
    c.ok(c.files("downloads") == expected, "PDFs are in docs/, images in images/, the rest in place")


@check("sum-sales")
def _sum_sales(c: Check) -> None:
    _answer(c, "total.txt", "668.00")


@check("filter-active")
def _filter_active(c: Check) -> None:
    expected = [["id", "name", "status"], ["1", "acme", "active"], ["3", "initech", "active"]]
    expected.append(["5", "hooli", "active"])
    c.ok(c.csv("active.csv") == expected, "active.csv holds the header and the active rows")


@check("add-factorial")
def _add_factorial(c: Check) -> None:
    code = "import mathutils as m; print([m.factorial(n) for n in (0, 1, 5, 10)], m.add(2, 3))"
    _python_prints(c, code, "[1, 1, 120, 3628800] 5")


@check("fix-unit-test")
def _fix_unit_test(c: Check) -> None:
    c.same_text("test_calc.py", (EXPECTED / "fix-unit-test" / "test_calc.py").read_text())
    done = c.run([sys.executable, "-m", "unittest", "test_calc"])
    c.ok(done is not None and done.returncode == 0, "python3 -m unittest test_calc passes")
    _python_prints(c, "from calc import subtract; print(subtract(7, 2))", "5")


@check("env-update")
def _env_update(c: Check) -> None:
    lines = c.lines("app.env") or []
    settings = [line.split("=", 1) for line in lines if line and not line.startswith("#")]
    expected = {"DEBUG": "false", "PORT": "8000", "DATABASE_URL": "postgres://app@db:5432/app"}
    expected["LOG_LEVEL"] = "info"
    c.ok(dict(settings) == expected and len(settings) == len(expected), "app.env holds the settings")
    c.ok("# settings for the web app" in lines, "the comment is kept")


@check("extract-emails")
def _extract_emails(c: Check) -> None:
    expected = [
        "j.smith+ops@example.net",
        "maria.lopez@example.com",
        "support@vendor.example",
        "tom@example.org",
    ]
    c.ok(c.lines("emails.txt") == expected, "emails.txt lists the addresses, sorted and unique")


@check("bump-version")
def _bump_version(c: Check) -> None:
    expected = {
        "name": "dashboard",
        "version": "1.5.0",
        "private": True,
        "scripts": {"build": "vite build", "test": "vitest"},
        "dependencies": {"react": "^18.2.0"},
    }
    c.ok(c.json("package.json") == expected, "package.json has version 1.5.0 and nothing else changed")


@check("log-time-window")
def _log_time_window(c: Check) -> None:
    expected = [
        "10:00:00 worker-2 job 311 finished",
        "10:07:45 worker-1 job 312 queued",
        "10:15:30 worker-3 job 312 started",
        "10:29:59 worker-3 job 312 failed",
    ]
    c.ok(c.lines("window.log") == expected, "window.log holds the lines from 10:00:00 to 10:29:59")


@check("sort-dedupe-names")
def _sort_dedupe_names(c: Check) -> None:
    expected = ["Ava", "Emma", "Liam", "Noah", "Olivia", "Sophia"]
    c.ok(c.lines("names.txt") == expected, "names.txt is sorted without duplicates")


@check("make-executable")
def _make_executable(c: Check) -> None:
    c.ok(os.access(c.workdir / "run.sh", os.X_OK), "run.sh is executable")
    done = c.run(["./run.sh"])
    c.ok(done is not None and done.stdout.strip() == "ready", "./run.sh prints ready")


@check("csv-to-markdown")
def _csv_to_markdown(c: Check) -> None:
    lines = [line.strip() for line in c.lines("scores.md") or [] if "|" in line]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    c.ok(len(rows) == 5 and rows[0] == ["name", "score"], "scores.md has the header row")
    c.ok(
        len(rows) == 5 and all(cell and set(cell) <= set("-:") for cell in rows[1]), "then the separator row"
    )
    c.ok(rows[2:] == [["ana", "91"], ["ben", "78"], ["cleo", "85"]], "then the rows in order")


@check("largest-file")
def _largest_file(c: Check) -> None:
    _answer(c, "largest.txt", "beta.log")


@check("fix-backup-script")
def _fix_backup_script(c: Check) -> None:
    # Run the script in a copy, so what the agent left in backup/ does not count.
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "w"
        shutil.copytree(c.workdir, copy, ignore=shutil.ignore_patterns("backup"))
        done = c.run(["sh", "backup.sh"], cwd=copy)
        c.ok(done is not None and done.returncode == 0, "sh backup.sh succeeds")
        notes = {f"{d}.txt": f"Notes for {d}.\n" for d in ("monday", "tuesday", "wednesday")}
        c.ok(Check(copy).files("backup") == notes, "backup/ holds a copy of every note")


@check("changelog-entry")
def _changelog_entry(c: Check) -> None:
    older = "## 1.4.2\n- Fix crash when the config file is empty\n\n## 1.4.1\n- Speed up start-up\n"
    older += "- Update dependencies"
    text = c.text("CHANGELOG.md") or ""
    head, sep, rest = text.partition("## 1.4.2")
    c.ok(sep + rest.rstrip() == older, "the older sections are unchanged")
    new = [line.strip() for line in head.splitlines() if line.strip()]
    c.ok(new == ["# Changelog", "## 1.5.0", "- Add export to CSV"], "a 1.5.0 section comes first")


@check("collect-todos")
def _collect_todos(c: Check) -> None:
    expected = [
        "src/app.py:5: read the port from the environment",
        "src/app.py:8: handle connection errors",
        "src/db.py:2: use a connection pool",
    ]
    c.ok(c.lines("todos.txt") == expected, "todos.txt lists the TODOs by path and line")


def main(task_id: str) -> int:
    if task_id not in CHECKS:
        print(f"checks.py: no check for task {task_id!r}", file=sys.stderr)
        return 2  # a verifier error, not a policy failure
    c = Check(Path.cwd())
    try:
        CHECKS[task_id](c)
    except Exception as exc:  # an odd final state (e.g. a folder where a file belongs) fails the task
        c.ok(False, f"the check crashed on this state: {exc!r}")
    reward = 1.0 if c.passed and not c.failed else 0.0
    print(json.dumps({"reward": reward, "passed": c.passed, "failed": c.failed}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
