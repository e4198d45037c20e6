"""Tensor-parallel layout rules of a run: when may the train TP differ from the rollout TP (docs/ops/linear_tp.md).

Without invariant mode a row-parallel linear sums per-rank partials (``rlk.gemm.bi.v1`` per rank, then the rank
tree), so its bits change with TP: train and rollout must use the same TP, or the log-probs differ. With
``RL_KERNEL_TP_INVARIANT=G`` every row-parallel linear runs ``rlk.gemm.tp.v1`` (G fixed K-leaves, one tree), and any
TP that is a power of two dividing G gives the same bits on either side. :func:`check_tp_layout` is the rule; strict
mode raises, audit mode returns the problem for the readback.
"""

from __future__ import annotations

from collections.abc import Mapping

from rlk_core import envs
from rlk_core.errors import RlkPolicyError

DEFAULT_LEAVES = 8  # G when the run does not say otherwise (RL_KERNEL_TP_INVARIANT=on); rlk_core.ops.linear_tp's


def tp_invariant_leaves(env: Mapping[str, str] | None = None) -> int:
    """G of the run (``RL_KERNEL_TP_INVARIANT``), 0 when invariant mode is off."""
    return envs.get("RL_KERNEL_TP_INVARIANT", env)


def tp_layout_problem(train_tp: int, rollout_tp: int, leaves: int) -> str | None:
    """What is wrong with training at ``train_tp`` and rolling out at ``rollout_tp`` with G = ``leaves`` (0: invariant
    mode off), or None."""
    for name, tp in (("train", train_tp), ("rollout", rollout_tp)):
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            return f"{name} TP must be a positive integer, got {tp!r}"
    if not leaves:
        if train_tp != rollout_tp:
            g = max(8, _pow2_at_least(max(train_tp, rollout_tp)))
            return (f"train TP {train_tp} != rollout TP {rollout_tp}: without TP-invariant mode a row-parallel "
                    f"linear's bits depend on TP, so the log-probs of the two sides differ. Set "
                    f"RL_KERNEL_TP_INVARIANT={g} on both sides (rlk.gemm.tp.v1), or use one TP")
        return None
    bad = [f"{name} TP {tp}" for name, tp in (("train", train_tp), ("rollout", rollout_tp))
           if tp & (tp - 1) or leaves % tp]
    if bad:
        return (f"{' and '.join(bad)} {'is' if len(bad) == 1 else 'are'} not a power of two dividing "
                f"RL_KERNEL_TP_INVARIANT={leaves} (each rank holds G / TP whole K-leaves): use such a TP or raise G "
                f"(the same G on both sides)")
    return None


def _pow2_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()


def check_tp_layout(train_tp: int, rollout_tp: int, *, env: Mapping[str, str] | None = None,
                    mode: str | None = None) -> str | None:
    """Apply the TP layout rule of the run (``RL_KERNEL_TP_INVARIANT``, ``RL_KERNEL_MODE`` unless ``mode`` is given):
    strict mode raises :class:`~rlk_core.errors.RlkPolicyError` with the message of :func:`tp_layout_problem`; audit
    mode returns it (for the readback) and the run continues; None when the layout is fine."""
    problem = tp_layout_problem(train_tp, rollout_tp, tp_invariant_leaves(env))
    if problem is not None and (mode or envs.get("RL_KERNEL_MODE", env)) == "strict":
        raise RlkPolicyError(f"strict mode: {problem}")
    return problem
