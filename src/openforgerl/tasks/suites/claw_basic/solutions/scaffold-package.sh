#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
mkdir -p mylib
printf '__version__ = "0.1.0"\n' > mylib/__init__.py
printf 'def greet(name):\n    return f"Hello, {name}!"\n' > mylib/core.py
printf '# mylib\n\nA tiny greeting library.\n' > README.md
