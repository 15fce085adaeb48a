#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
sed -i 's/(len(values) + 1)/len(values)/' stats.py
