"""Built-in task suites: `tools_tiny` and `tools_tiny_reworded` (generated) and `claw_basic` (data
files in its folder)."""

from pathlib import Path

CLAW_BASIC_DIR = Path(__file__).parent / "claw_basic"
