#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
grep -oE '[A-Za-z0-9._+-]+@[A-Za-z0-9.-]+\.[A-Za-z]+' contacts.txt | LC_ALL=C sort -u > emails.txt
