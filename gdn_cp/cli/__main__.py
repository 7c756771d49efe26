"""``python -m gdn_cp.cli``: the ``gdn-cp`` command without the console script."""

import sys

from .command import main

sys.exit(main())
