#!/bin/bash
# Partial rewards: 0.5 for a UTF-8 copy with the right table, 0.5 for the original left untouched.
reward=0
expected=$(printf 'item,price\nK\xc3\xa4se,4.20\nCr\xc3\xa8me,2.10\n')
if [ -f /app/prices-utf8.csv ] && [ "$(head -c 3 /app/prices-utf8.csv | od -An -tx1 | tr -d ' ')" != efbbbf ] \
   && [ "$(cat /app/prices-utf8.csv)" = "$expected" ]; then
  reward=$(awk "BEGIN {print $reward + 0.5}")
fi
if [ "$(head -c 2 /app/prices.csv | od -An -tx1 | tr -d ' ')" = fffe ] && [ "$(iconv -f UTF-16 -t UTF-8 /app/prices.csv)" = "$expected" ]; then
  reward=$(awk "BEGIN {print $reward + 0.5}")
fi
echo "$reward" > /logs/verifier/reward.txt
