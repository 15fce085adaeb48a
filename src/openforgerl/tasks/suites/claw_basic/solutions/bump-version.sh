#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
sed -i 's/"version": "1.4.2"/"version": "1.5.0"/' package.json
