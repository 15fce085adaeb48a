#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
awk -F, 'NR == 1 || $3 == "active"' accounts.csv > active.csv
