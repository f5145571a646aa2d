"""The ``pyserve`` command line (``pyserve.cli.main``): the subcommands, their flags and the
Triton-compatible spellings (``triton_flags``), and ``pyserve new`` (``scaffold``)."""
