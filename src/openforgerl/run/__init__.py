"""The layer that owns a run: what its folder holds (`folder.py`: every file a run writes, and its
status), and what serves it while it runs (`stack.py`: the engine, the embedded gateway in front
of it and the rollout service on that gateway, started and closed in order). `openforge eval`,
`rollout`, `train`, `sft --teacher`, the harness study and the demo are recipes on it."""
