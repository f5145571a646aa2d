"""``python -m pyserve`` runs the command line."""

from pyserve.cli.main import main

raise SystemExit(main())
