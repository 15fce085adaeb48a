#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
python3 - <<'EOF'
import csv, json
rows = [{**r, "age": int(r["age"])} for r in csv.DictReader(open("people.csv"))]
json.dump(rows, open("people.json", "w"), indent=2)
EOF
