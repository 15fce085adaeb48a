#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
grep -rl 'oldcorp\.example' site | xargs sed -i 's/oldcorp\.example/newcorp.example/g'
