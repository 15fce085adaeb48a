"""The shipped Hydra configs (YAML). A package so that a config of your own can reach them with
`hydra: {searchpath: [pkg://openforgerl.integrations.verl.config]}` and `defaults: [qwen3_grpo]`."""
