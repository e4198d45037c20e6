"""rlk-repro: the consistency experiment's launcher and its embedded ``local`` engine.

Importing this package has no side effects; ``rlk_repro.cli:main`` is the ``rlk-repro`` command.
"""

__version__ = "0.1.0"
