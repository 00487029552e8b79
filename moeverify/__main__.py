"""``python -m moeverify``: the same as the ``moeverify`` command."""

import sys

from moeverify.cli import main

sys.exit(main())
