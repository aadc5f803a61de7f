"""``python -m membudget ...``: the same command line as the ``membudget`` script.

Where this sits in the flow: a thin entry point that hands ``sys.argv`` to
:func:`membudget.cli.main` and exits with its status.
"""
import sys

from membudget.cli import main

if __name__ == "__main__":
    sys.exit(main())
