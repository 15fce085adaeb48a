#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
printf 'print("Hello, OpenForge!")\n' > hello.py
