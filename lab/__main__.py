"""The ``lab`` command (and ``python -m lab``): imports the CLI, then runs it.

Importing the CLI takes a few tenths of a second (click, ruamel.yaml, the config
module); a Ctrl-C then, before ``lab.cli.main`` handles interrupts, used to print
Python's import traceback. This module is kept free of imports of its own so that it
can catch it.
"""

import sys


def main() -> int:
    try:
        from lab.cli import main as cli_main
    except KeyboardInterrupt:
        print("\ninterrupted while lab was starting; nothing was done", file=sys.stderr)
        return 130
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
