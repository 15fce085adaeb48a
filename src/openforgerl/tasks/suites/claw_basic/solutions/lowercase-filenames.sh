#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
for f in docs/*; do
    b=$(basename "$f")
    l=$(printf '%s' "$b" | tr 'A-Z' 'a-z')
    if [ "$b" != "$l" ]; then mv "$f" "docs/$l"; fi
done
