"""The ``gdn-cp`` command (the top layer: it calls every other layer, nothing calls it).

``command.py``: the top-level parser, ``route``, ``doctor`` and ``selftest``'s flags; ``run.py`` +
``main_job.py``: ``gdn-cp run``; ``patch.py``: ``gdn-cp patch``; ``selftest.py``: ``gdn-cp
selftest``; ``args.py``: the one strict integer / comma-list syntax of every flag.
``python -m gdn_cp.cli`` is the ``gdn-cp`` console script.
"""

from .command import build_parser, main

__all__ = ["build_parser", "main"]
