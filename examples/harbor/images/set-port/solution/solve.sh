#!/bin/bash
python3 -c 'import json; p = "/app/config.json"; c = json.load(open(p)); c["port"] = 8080; json.dump(c, open(p, "w"))'
