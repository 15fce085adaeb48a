#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
python3 - <<'EOF'
import collections, json
counts = collections.Counter(line.split()[2].split("=")[1] for line in open("logs/access.log") if line.strip())
json.dump(counts, open("status_counts.json", "w"), indent=2)
EOF
