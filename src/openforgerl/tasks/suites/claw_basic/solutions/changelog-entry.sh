#!/usr/bin/env bash
# Reference solution (tests only): run in the task's work directory.
set -euo pipefail
python3 - <<'EOF'
text = open("CHANGELOG.md").read()
open("CHANGELOG.md", "w").write(text.replace("## 1.4.2", "## 1.5.0\n- Add export to CSV\n\n## 1.4.2", 1))
EOF
