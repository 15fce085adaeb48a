#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
grep -n 'TODO:' src/*.py | sed -E 's/^([^:]+:[0-9]+):.*TODO: */\1: /' > todos.txt
