"""Run `openforge train --backend verl cpu_grpo` on a two-node Ray cluster (ray.cluster_utils).

Run inside the network namespace `make test-verl`'s test makes (netns.wrap): it starts a head node
and a second node, one logical GPU each, then veRL's trainer on them with `trainer.nnodes=2`
(one FSDP worker and one rollout replica per node). Usage: python verl_two_nodes.py OVERRIDES...
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from ray.cluster_utils import Cluster


def main() -> int:
    t0 = time.monotonic()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 8, "num_gpus": 1},
        connect=False,
    )
    cluster.add_node(num_cpus=8, num_gpus=1)
    cluster.wait_for_nodes()
    print(f"two-node cluster at {cluster.address} in {time.monotonic() - t0:.1f}s", flush=True)
    command = [
        sys.executable,
        "-m",
        "openforgerl.cli",
        "train",
        "--backend",
        "verl",
        "cpu_grpo",
        f"ray_kwargs.ray_init.address={cluster.address}",
        "ray_kwargs.ray_init.num_cpus=null",
        "ray_kwargs.ray_init.num_gpus=null",
        "trainer.nnodes=2",
        "trainer.n_gpus_per_node=1",
        *sys.argv[1:],
    ]
    try:
        return subprocess.call(command, env={**os.environ, "RAY_ADDRESS": cluster.address})
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
