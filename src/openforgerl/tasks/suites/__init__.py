"""Built-in task suites: `tools_tiny`, `tools_tiny_reworded` and `web_basic` (generated; web-basic's
tasks run on the local sites of `openforgerl.web`) and `claw_basic` (data files in its folder)."""

from pathlib import Path

CLAW_BASIC_DIR = Path(__file__).parent / "claw_basic"
