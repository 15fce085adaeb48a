#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
python3 - <<'EOF'
import csv, json
with open("inventory.csv", "w", newline="") as f:
    out = csv.DictWriter(f, fieldnames=["sku", "name", "qty"])
    out.writeheader()
    out.writerows(json.load(open("inventory.json")))
EOF
