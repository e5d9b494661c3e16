"""``python -m pipesplit``: the command-line interface."""

from pipesplit.cli import main

raise SystemExit(main())
