#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
sed -i 's/return b - a/return a - b/' calc.py
