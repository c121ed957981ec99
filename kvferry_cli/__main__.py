"""`python -m kvferry_cli ...`: the `kvferry` command without its console script."""

from kvferry_cli.command import main

raise SystemExit(main())
