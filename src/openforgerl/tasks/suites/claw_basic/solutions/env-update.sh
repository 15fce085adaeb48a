#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
sed -i 's/^DEBUG=true$/DEBUG=false/' app.env
echo LOG_LEVEL=info >> app.env
