"""One module per ``pdserve`` subcommand: each has ``register(subparsers)`` and ``run(args)``."""
