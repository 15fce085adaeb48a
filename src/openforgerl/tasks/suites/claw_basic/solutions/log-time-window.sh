#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
awk '$1 >= "10:00:00" && $1 < "10:30:00"' logs/server.log > window.log
