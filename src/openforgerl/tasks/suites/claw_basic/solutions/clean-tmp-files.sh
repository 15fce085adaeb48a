#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
find build -type f -name '*.tmp' -delete
