"""Training: the embedded trainer (RL and SFT) on the samples the gateway recorded.

- `algos`: advantages, policy losses, truncated importance sampling and KL, all from veRL.
- `trainer`: the embedded PyTorch trainer (any HF causal LM; CPU or one GPU).
- `sft`: supervised fine-tuning on recorded trajectories or chat conversations.
- `oracle_teacher`: the rule-based tools-tiny teacher that produces SFT trajectories.
- `loop`: rollouts through an embedded gateway, training, weight pushes, checkpoints, resume.

Import the submodules directly; this package imports nothing heavy.
"""
