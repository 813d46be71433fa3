"""Sub-commands of the ``dflash`` command; each module exposes ``register(subparsers)``.

``register`` adds one sub-parser and sets its default ``run`` to a function taking the
parsed ``argparse.Namespace`` and returning the process exit code.
"""
