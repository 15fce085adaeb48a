"""What the Kubernetes tests share: against the fake API server (test_kubernetes.py) and against the
real cluster (test_k8s_cluster.py)."""

from __future__ import annotations

from openforgerl.tasks import Task


def word_tasks(n: int, timeout: int) -> list[Task]:
    """n tasks whose verifier wants one exact line in answer.txt: a one-call agent can pass each."""
    return [
        Task(
            id=f"word-{i}",
            instruction=f"Say the magic word: magic-{i}-word",
            split="test",
            verifier={"command": f"grep -qx 'magic-{i}-word' answer.txt"},
            timeout=timeout,
        )
        for i in range(n)
    ]
