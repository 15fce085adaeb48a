#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
printf '#!/bin/sh\necho ready\n' > run.sh
chmod +x run.sh
