"""Tasks as data: the schema (`tasks.schema`, documented there), loaders, built-in suites, verifiers."""

from openforgerl.tasks.files import TaskError
from openforgerl.tasks.loader import (
    dump_tasks,
    load_task_file,
    load_tasks,
    register_suite,
    suite_names,
)
from openforgerl.tasks.schema import CommandVerifier, Fault, PythonVerifier, Resources, Split, Task
from openforgerl.tasks.verify import (
    SetupError,
    VerifierError,
    VerifierResult,
    parse_verifier_output,
    prepare_local,
    verify_local,
)

__all__ = [
    "CommandVerifier",
    "Fault",
    "PythonVerifier",
    "Resources",
    "SetupError",
    "Split",
    "Task",
    "TaskError",
    "VerifierError",
    "VerifierResult",
    "dump_tasks",
    "load_task_file",
    "load_tasks",
    "parse_verifier_output",
    "prepare_local",
    "register_suite",
    "suite_names",
    "verify_local",
]
