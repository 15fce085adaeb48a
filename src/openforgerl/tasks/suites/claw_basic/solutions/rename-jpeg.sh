#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
for f in photos/*.jpeg; do mv "$f" "${f%.jpeg}.jpg"; done
