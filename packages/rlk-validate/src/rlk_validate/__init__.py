"""rlk-validate: check an rlk run directory and say, with evidence, whether the claim holds.

Public entry points: :func:`validate_run`, :func:`validate_matrix`, :func:`seal_run`.
Importing this package has no side effects and never imports torch.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .findings import CODES, Finding
from .matrix import validate_matrix
from .sealing import seal_run
from .validate import Options, validate_run

__all__ = ["CODES", "Finding", "Options", "__version__", "seal_run", "validate_matrix", "validate_run"]
