"""The ``rlk_qualify_backend`` hook: rlk's contract checks, offered to the backend registry.

rlk-core registers this module under the ``rlk.backends`` entry-point group (as ``rlk-qualification``),
so the registry reaches the checks of :mod:`rlk_core.testing.qualify` through its plug-in manager and
never imports the test suites itself.
"""

from __future__ import annotations

from rlk_core.backends import Backend, hookimpl
from rlk_core.testing.qualify import qualify_backend


@hookimpl
def rlk_qualify_backend(backend: Backend, device_type: str) -> tuple[bool, str]:
    return qualify_backend(backend, device_type)
