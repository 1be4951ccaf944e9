"""``python -m memkit``: the command line (see :mod:`memkit.cli`)."""

from .cli import main

raise SystemExit(main())
