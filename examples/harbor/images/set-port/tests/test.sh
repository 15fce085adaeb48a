#!/bin/bash
# reward.json: 1 when the port is 8080 and nothing else changed (python3 is in the image).
python3 - <<'PY'
import json
try:
    got = json.load(open("/app/config.json"))
    ok = got == {"name": "shop", "port": 8080, "debug": False}
except (OSError, ValueError) as e:
    got, ok = str(e), False
json.dump({"reward": int(ok), "got": str(got)[:200]}, open("/logs/verifier/reward.json", "w"))
PY
