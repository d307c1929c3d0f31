"""`python -m service` runs the kvstitch CLI."""

from service.cli import main

raise SystemExit(main())
