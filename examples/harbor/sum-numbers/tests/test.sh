#!/bin/bash
# reward.json: 1 when /app/sum.txt holds the sum of /app/numbers.txt, else 0, with what was found.
expected=$(awk '{s += $1} END {print s}' /app/numbers.txt)
got=$(tr -d '[:space:]' < /app/sum.txt 2>/dev/null)
reward=0
[ "$got" = "$expected" ] && reward=1
printf '{"reward": %s, "expected": "%s", "got": "%s"}\n' "$reward" "$expected" "$got" > /logs/verifier/reward.json
