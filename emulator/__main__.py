"""``python -m emulator``: same as ``kvferry emulate``."""

from emulator.cli import main

raise SystemExit(main())
