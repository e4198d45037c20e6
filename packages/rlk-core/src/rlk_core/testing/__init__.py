"""Shared test helpers: invariance checks, bitwise comparison with diff reports, tolerances.

Users can call these on their own hardware. :mod:`rlk_core.testing.contracts` assembles them into each
op's contract suite, which ``rlk-selfcheck``, backend qualification and the tests run.
"""

from rlk_core.testing.compare import (
    assert_bitwise_equal,
    assert_close_to_formula,
    bitwise_diff_report,
    dtype_tols,
)
from rlk_core.testing.invariance import check_batch_invariance, check_run_to_run

__all__ = [
    "assert_bitwise_equal",
    "assert_close_to_formula",
    "bitwise_diff_report",
    "check_batch_invariance",
    "check_run_to_run",
    "dtype_tols",
]
