"""``python -m routerd`` runs the ``phasewise`` command line."""

from routerd.cli import main

raise SystemExit(main())
