"""`python -m openforgerl.cli`: the `openforge` command."""

from openforgerl.cli import main

if __name__ == "__main__":
    main()
