"""`python -m mtrain` and the `mtrain` console script: Ctrl-C is honoured from the first moment.

The commands import torch, which takes seconds; a Ctrl-C during them must end with exit status
130 and one line, not a traceback. So this module imports nothing until the handler is in place.
"""

import sys


def main() -> None:
    """Install the Ctrl-C handler, then import and run the command line."""
    try:
        import signal

        # Python leaves SIGINT ignored when it starts ignored (a job that a script started with
        # `&`), while training installs a handler of its own: Ctrl-C would stop some phases and
        # be lost in others. It stops all of them.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # torch's C extension imports numpy and drops any error it raises, a Ctrl-C's included:
        # imported here first, a Ctrl-C during numpy's import stops the command as it should.
        import numpy  # noqa: F401

        from mtrain import cli
    except KeyboardInterrupt:
        sys.stderr.write("mtrain: interrupted\n")
        sys.exit(130)
    cli.main()


if __name__ == "__main__":
    main()
