"""Qualification of a backend against its contract before strict mode accepts it.

A backend that is not built into rlk (say, a Blackwell or ROCm kernel package registering itself
through the ``rlk.backends`` entry points) must show, on the device it will run on, that it keeps
the contract: it runs the op's checks of the contract suite (:mod:`rlk_core.testing.contracts`: batch
invariance, run-to-run, agreement with rlk's reference, and the op's own invariances), in fp32 and bf16,
on small random inputs; it takes seconds. Family ops are qualified as a family: a backend id that claims
one forward attention op must register all three (prefill, chunked prefill and decode must agree bit for
bit), and ``linear_logprobs`` must equal ``token_logprobs(linear(...))`` with the same id's ``linear``
and ``token_logprobs``.
"""

from __future__ import annotations

from rlk_core.testing.contracts import ATTENTION_FORWARD, SUITES, checks, for_backend, run_check

__all__ = ["ATTENTION_FORWARD", "qualify_backend"]


def qualify_backend(backend, device_type: str) -> tuple[bool, str]:
    """Run the contract checks of ``backend.op`` with ``backend.fn`` on ``device_type``: ``(ok, reason)``,
    the reason naming the first check that failed."""
    if backend.op not in SUITES:
        return False, (f"no qualification suite for op {backend.op!r} yet; "
                       "strict mode accepts only rlk's built-in backends")
    subject = for_backend(backend)
    passed = []
    for check in checks(subject, device_type):
        ok, detail = run_check(check, subject, device_type)
        if not ok:
            return False, f"{check.name}: {detail}"
        passed.append(check.name)
    return True, f"passed in fp32 and bf16: {', '.join(passed)}"
