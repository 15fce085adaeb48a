#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
awk '$3 == "ERROR"' logs/app.log | wc -l > error_count.txt
