"""``python -m pyserve`` runs the command line."""

from pyserve.cli import main

raise SystemExit(main())
