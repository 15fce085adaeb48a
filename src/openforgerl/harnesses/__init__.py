"""Harnesses: every agent program a rollout can run inside its sandbox, and how it is launched.

- `launch.py`: one launch path for all of them (`HarnessChoice`: each task under its harness), the
  runner's `HarnessFactory`/`HarnessLaunch` contract, and what of this package a sandbox sees.
- `react.py`, `gui.py`: the built-in harnesses (a ReAct tool loop; a browser agent on screenshots),
  run inside the sandbox as `python -m openforgerl.harnesses.react|gui` (the GUI harness's browser:
  `gui_browser.py`).
- `adapters.py` (`get(name)`, `HARNESSES`) and one module per real agent CLI, behind the `Harness`
  protocol of `base.py`.

This file imports nothing: the built-in harnesses run in sandboxes that see only their own modules.
"""
