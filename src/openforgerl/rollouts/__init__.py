"""Rollouts: the one seam between running agents and training on them.

- `service.py`: tasks in, one `RolloutResult` per rollout out (status, reward, the recorded calls as
  typed records, the samples); eval, RL, SFT's teacher and the veRL agent loop all call it.
- `runner.py`: the runner (sandboxes, harnesses, verifiers, retries, concurrency).
- `results.py`: a rollout's result (the reward's one source of truth) and the run's durable state.
- `admin.py`: the typed client of the gateway's admin API (the one reader of a rollout's calls).
- `trajectory.py`: a recorded call's typed record, and recorded calls + reward -> training samples.

This file imports nothing, so that the trainer and the viewer import trajectory.py alone.
"""
