#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
mkdir -p downloads/docs downloads/images
mv downloads/*.pdf downloads/*.PDF downloads/docs/
mv downloads/*.png downloads/*.jpg downloads/images/
