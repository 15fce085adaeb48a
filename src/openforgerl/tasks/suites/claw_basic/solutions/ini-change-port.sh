#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
sed -i '/^\[server\]/,/^\[/ s/^port = 8080$/port = 9090/' settings.ini
