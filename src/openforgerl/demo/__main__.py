"""`python -m openforgerl.demo` (`make demo`): see openforgerl/demo/pipeline.py."""

from openforgerl.demo.command import main

main()
