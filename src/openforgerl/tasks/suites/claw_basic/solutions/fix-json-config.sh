#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
python3 - <<'EOF'
import re
text = open("config.json").read()
open("config.json", "w").write(re.sub(r",(\s*[}\]])", r"\1", text))
EOF
