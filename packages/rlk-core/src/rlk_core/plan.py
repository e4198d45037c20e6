"""The route plan: which implementation runs each module on each side.

A case is ``X/Y``: X for the train side (Megatron), Y for the rollout side (vLLM); ``P`` is the
framework's production implementation, ``R`` is rlk. The user-facing presets are ``native`` (all P/P)
and ``consistency`` (all R/R); mixed cells attribute drift to one module and one side.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rlk_core import envs
from rlk_core.errors import RlkConfigError
from rlk_validate.evidence import MODULES, SIDES

CASES = envs.CASES
parse_case = envs.parse_case
CASE_VARS = envs.CASE_VARS


@dataclass(frozen=True)
class RoutePlan:
    attention: str = "P/P"
    ffn: str = "P/P"
    logp: str = "P/P"

    def __post_init__(self) -> None:
        for module in MODULES:
            case = getattr(self, module)
            if case not in CASES:
                raise RlkConfigError(f"case of module {module!r} is {case!r}; allowed: {', '.join(CASES)}")

    def case(self, module: str) -> str:
        if module not in MODULES:
            raise RlkConfigError(f"module {module!r} is not one of {', '.join(MODULES)}")
        return getattr(self, module)

    def letter(self, module: str, side: str) -> str:
        """``'P'`` or ``'R'`` for one module on one side."""
        if side not in SIDES:
            raise RlkConfigError(f"side {side!r} is not one of {', '.join(SIDES)}")
        return self.case(module).split("/")[SIDES.index(side)]

    def uses_rlk(self, module: str, side: str) -> bool:
        return self.letter(module, side) == "R"

    def implementation(self, module: str, side: str) -> str:
        return "rlk" if self.uses_rlk(module, side) else "production"

    def as_dict(self) -> dict[str, str]:
        return {m: self.case(m) for m in MODULES}

    def env(self) -> dict[str, str]:
        """The environment variables that select this plan in another process."""
        return {CASE_VARS[m]: self.case(m) for m in MODULES}

    @property
    def name(self) -> str:
        for preset, plan in PRESETS.items():
            if plan == self:
                return preset
        return ",".join(f"{m}={self.case(m)}" for m in MODULES)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RoutePlan:
        return cls(**{m: envs.get(CASE_VARS[m], environ) for m in MODULES})

    @classmethod
    def from_dict(cls, data: Mapping[str, str]) -> RoutePlan:
        unknown = set(data) - set(MODULES)
        if unknown:
            raise RlkConfigError(f"unknown module(s) {sorted(unknown)}; allowed: {', '.join(MODULES)}")
        return cls(**{m: parse_case(data.get(m, "P/P"), f"plan[{m!r}]") for m in MODULES})

    @classmethod
    def preset(cls, name: str) -> RoutePlan:
        try:
            return PRESETS[name]
        except KeyError:
            raise RlkConfigError(f"preset {name!r} is not one of {', '.join(PRESETS)}") from None


PRESETS: dict[str, RoutePlan] = {
    "native": RoutePlan("P/P", "P/P", "P/P"),
    "consistency": RoutePlan("R/R", "R/R", "R/R"),
}
