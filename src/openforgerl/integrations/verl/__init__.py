"""OpenForgeRL at scale on veRL: our rollouts inside veRL's trainer.

veRL (0.9.1, V1 trainer) owns the model, the vLLM/SGLang servers and the GRPO update; for every
dataset row it calls an agent loop. Ours (`agent_loop.OpenForgeAgentLoop`, registered as
"openforge" through the `verl.plugins` entry point) runs the row's task through OpenForgeRL's own
runner: a sandbox, a real harness, a gateway whose engine *is* veRL's server manager
(`engine.VerlServerEngine`), the task's verifier for the reward, and the trajectory builder over
what the gateway recorded. The merged samples go back to veRL as `list[AgentLoopOutput]`.

Modules:
    plugin       the `verl.plugins` entry point: registers the agent loop, the rollout, the CPU platform
    engine       the Engine protocol over veRL's `server_manager.generate` (no veRL import)
    samples      Sample -> (prompt, response, mask, logprobs) within veRL's length limits
    agent_loop   the AgentLoopBase subclass and the one gateway per worker process
    replica      the "openforge" rollout replica: the project's TransformersEngine as a Ray actor
    rollout      its worker-side adapter: the FSDP actor's weights into the engine after each step
    cpu          veRL's platform interface on the CPU (VERL_PLATFORM=cpu)
    netns        a network (and PID) namespace with loopback only, where Ray runs on CPU
    data         dataset rows (parquet or JSONL) for `RLHFDataset`
    launch       `openforge train --backend verl`: veRL's main with our Hydra config
    config/      the shipped Hydra configs: recipe/grpo.yaml shared by qwen3_grpo (GPU) and
                 cpu_grpo (CPU), composed on veRL's own ppo_trainer defaults

Importing this package does not import veRL; `plugin`, `agent_loop`, `replica`, `rollout` and
`cpu` do.
"""
