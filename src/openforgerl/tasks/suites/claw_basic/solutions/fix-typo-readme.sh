#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
sed -i 's/Instalation/Installation/g; s/instalation/installation/g; s/recieve/receive/g' README.md
