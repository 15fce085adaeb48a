#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
python3 - <<'EOF'
import csv
from decimal import Decimal
names = {r["id"]: r["name"] for r in csv.DictReader(open("users.csv"))}
totals = {name: Decimal(0) for name in names.values()}
for r in csv.DictReader(open("orders.csv")):
    totals[names[r["user_id"]]] += Decimal(r["amount"])
with open("totals.csv", "w", newline="") as f:
    out = csv.writer(f)
    out.writerow(["name", "total"])
    out.writerows([name, f"{totals[name]:.2f}"] for name in sorted(totals))
EOF
