"""Exceptions raised by rlk. Every message names what was wrong, the value and what is allowed."""


class RlkError(Exception):
    """Base class of rlk errors."""


class RlkConfigError(RlkError, ValueError):
    """A configuration variable or argument has a value outside its allowed set."""


class RlkInputError(RlkError, ValueError):
    """An operator received inputs that violate its documented shapes, dtypes or ranges."""


class RlkPolicyError(RlkError):
    """The fail-closed policy rejected what ran (a fallback on an R side, an rlk backend on a P side)."""


class RlkBackendError(RlkError):
    """A backend could not be selected, loaded or qualified for its contract id."""
