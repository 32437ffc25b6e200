"""The ``pyxllm`` command: :func:`pyxllm.cli.main.main` and one module per subcommand (``serve``,
``generate``, ``check_device``, ``bench``, ``run_batch``, ``env``, ``chat``), each with
``add_parser(commands, formatter)``, ``run(args, config)`` and, where it checks its flags
together, ``check(args, parser)``.

The top of the stack: it may import every other part of pyxllm, and nothing imports it.
"""
