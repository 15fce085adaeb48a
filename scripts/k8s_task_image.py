"""Makes a task image for Kubernetes Pods: BASE (any image with python3, sh, tar, setsid) plus the
modules the built-in harnesses run, at the path where a container's python3 finds them
(`harnesses/launch.py`: PYTHON_INSIDE). The Docker backend binds those modules into each container; a
Pod sees only its image, so there they must be in it. Built by the docker CLI ($DOCKER_HOST: for
`make k8s-up`'s cluster, the kubelet's own engine, `scripts/k8s_cluster.sh env`), without a registry.

    python scripts/k8s_task_image.py BASE TAG
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import openforgerl
from openforgerl.harnesses.launch import PYTHON_INSIDE, SANDBOX_MODULES


def main(base: str, tag: str) -> None:
    package = Path(openforgerl.__file__).parent
    with tempfile.TemporaryDirectory() as ctx:
        for module in SANDBOX_MODULES:
            if (package / module).is_file():
                dest = Path(ctx, "python", "openforgerl", module)
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes((package / module).read_bytes())
        # A file of the image's own, so a test can tell that a Pod runs this image.
        Path(ctx, "Dockerfile").write_text(
            f"FROM {base}\nCOPY python {PYTHON_INSIDE}\nRUN echo {tag} > /etc/openforge-image\n"
        )
        subprocess.run(["docker", "build", "-q", "-t", tag, ctx], check=True, stdout=subprocess.DEVNULL)
    print(f"made {tag}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
