#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
cat >> mathutils.py <<'EOF'


def factorial(n):
    result = 1
    for i in range(2, n + 1):
        result *= i
    return result
EOF
