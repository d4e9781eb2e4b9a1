"""``python -m commbench`` (and ``torchrun -m commbench``) runs the CLI."""

from commbench.cli import main

if __name__ == "__main__":
    main()
