#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
awk '{ split($3, s, "="); if (s[2] + 0 >= 500) { split($2, r, "="); print r[2] } }' logs/access.log \
    | LC_ALL=C sort -u > failed.txt
