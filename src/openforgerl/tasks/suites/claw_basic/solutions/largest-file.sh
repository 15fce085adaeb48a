#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
ls -S data | head -n 1 > largest.txt
