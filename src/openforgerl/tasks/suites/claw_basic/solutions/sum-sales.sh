#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
awk -F, 'NR > 1 { s += $3 } END { printf "%.2f\n", s }' sales.csv > total.txt
