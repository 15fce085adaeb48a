#!/bin/bash
if [ "$(/app/greet.sh Ada 2>/dev/null)" = "Hello, Ada" ] && [ "$(/app/greet.sh Bo 2>/dev/null)" = "Hello, Bo" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
