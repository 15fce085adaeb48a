"""OpenForgeRL: train agents inside the harnesses they really run in."""

import os

# Idle OpenMP threads sleep instead of spinning: with the engine, the trainer and the sandboxes on
# 2 cores, spinning made a decode step 10x slower, and PASSIVE cut a 20k-token harness turn from
# 9.3 to 7 s cold, 2.5 to 1.3 s warm (benchmarks/README.md). It must be set before torch loads its
# OpenMP runtime; an explicit setting wins. On a machine left to the engine alone ACTIVE decodes up to
# 1.9x faster (SmolLM2-135M, README "A real pretrained model"): set it there.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
