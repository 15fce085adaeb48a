#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
LC_ALL=C sort -u names.txt -o names.txt
