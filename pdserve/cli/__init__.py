"""The ``pdserve`` command (main.py), one module per subcommand (commands/), the process
launcher of ``pdserve up`` (launcher.py) and the engine flags every engine command shares
(engine_args.py). Apart from the generated stubs (pdserve.<area>.v1) and the Python client
(pdserve.client), which applications import without the CLI."""
