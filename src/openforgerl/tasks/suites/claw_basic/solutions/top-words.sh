#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
sort words.txt | uniq -c | sort -rn | head -3 | awk '{print $2}' > top3.txt
