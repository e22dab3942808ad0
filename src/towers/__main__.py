"""``python -m towers``: the ``towers`` command."""

import sys

from .tools.cli import main

sys.exit(main())
