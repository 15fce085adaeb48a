#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
find src -name '*.py' -exec cat {} + | wc -l > loc.txt
