"""Every megatron-core name the provider uses, with the version range it was verified against.

Supported: megatron-core 0.16.x (what slime/VIME pin; exercised on CPU in CI) through 0.19.x (the newest:
the same CPU suite by ``scripts/test-megatron-019.sh``, and the GPU benchmark). Differences handled here by
feature detection, never by version string:

- the MLP slot of ``TransformerLayerSubmodules``: a ``ModuleSpec`` in 0.16, an ``MlpBuilder`` callable
  (``partial(MLP.as_mlp_submodule, submodules=...)``) in 0.19 (detected by ``MLP.as_mlp_submodule``);
- ``transformer_block._get_block_submodules`` (the stock block spec for a layer spec): keyword set read
  with :mod:`inspect`;
- ``HybridModel`` / ``HybridStack`` (``megatron.core.models.hybrid``, new in 0.19, where ``GPTModel`` is
  deprecated in its favour): detected by importing it (:func:`hybrid`; ``None`` on 0.16).

Importing this module imports megatron.core (the package's ``__init__`` never does so eagerly).
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel  # noqa: F401
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: F401
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: F401
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear  # noqa: F401
from megatron.core.transformer import transformer_block as _block
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules  # noqa: F401
from megatron.core.transformer.enums import AttnMaskType  # noqa: F401
from megatron.core.transformer.identity_op import IdentityOp  # noqa: F401
from megatron.core.transformer.mlp import MLP, MLPSubmodules  # noqa: F401
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: F401
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules  # noqa: F401

# Inclusive lower bound, exclusive upper bound of the verified megatron-core range.
SUPPORTED = ((0, 16), (0, 20))


def _version_tuple(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def version() -> str:
    """The installed megatron-core version (distribution metadata; Megatron-LM checkouts use the
    package's ``__version__``)."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        import megatron.core

        return str(getattr(megatron.core, "__version__", "unknown"))


def supported(v: str | None = None) -> tuple[bool, str]:
    """``(ok, reason)``: whether megatron-core ``v`` (default: the installed one) is in the verified range."""
    v = version() if v is None else v
    t = _version_tuple(v)
    if len(t) < 2 or not (SUPPORTED[0] <= t < SUPPORTED[1]):
        lo, hi = SUPPORTED
        return False, (f"megatron-core {v} is outside the verified range >= {lo[0]}.{lo[1]}, "
                       f"< {hi[0]}.{hi[1]}")
    return True, f"megatron-core {v}"


MLP_IS_BUILDER = hasattr(MLP, "as_mlp_submodule")


def mlp_slot(mlp_cls: type, submodules) -> object:
    """The value of ``TransformerLayerSubmodules.mlp`` that builds ``mlp_cls`` with ``submodules``."""
    if MLP_IS_BUILDER:
        return functools.partial(mlp_cls.as_mlp_submodule, submodules=submodules)
    return ModuleSpec(module=mlp_cls, submodules=submodules)


def mlp_parts(slot) -> tuple[type | None, object | None]:
    """``(class, MLPSubmodules)`` of a layer spec's MLP slot, whichever form it takes; ``(None, None)``
    when it is not a dense MLP this module can read (e.g. MoE)."""
    if isinstance(slot, ModuleSpec):
        return slot.module, slot.submodules
    if isinstance(slot, functools.partial):
        # a partial of a classmethod (0.19's dense MLP) or of the class itself (0.19's MoELayer)
        owner = slot.func if isinstance(slot.func, type) else getattr(slot.func, "__self__", None)
        return owner, slot.keywords.get("submodules")
    return None, None


def stock_block_submodules(config, layer_spec, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """Megatron's own block spec (layer list + final norm class) for a layer spec (``vp_stage``: the
    virtual pipeline stage, where the installed version takes one)."""
    params = inspect.signature(_block._get_block_submodules).parameters
    kwargs = {"vp_stage": vp_stage} if "vp_stage" in params else {}
    return _block._get_block_submodules(config, layer_spec, **kwargs)


@functools.cache
def hybrid():
    """The HybridModel names (``HybridModel``, ``HybridStack``, ``HybridStackSubmodules``, ``MLPLayer``,
    ``Symbols``) as a namespace, or ``None`` where the installed megatron-core has no HybridModel."""
    import types

    try:
        from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
        from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
        from megatron.core.models.hybrid.hybrid_model import HybridModel
        from megatron.core.ssm.mlp_layer import MLPLayer
    except ImportError:
        return None
    return types.SimpleNamespace(HybridModel=HybridModel, HybridStack=HybridStack,
                                 HybridStackSubmodules=HybridStackSubmodules, MLPLayer=MLPLayer, Symbols=Symbols)


def tp_group_of(module) -> object:
    """The TP group a Megatron layer was built with."""
    g = getattr(module, "tp_group", None)
    return g if g is not None else parallel_state.get_tensor_model_parallel_group()


@functools.cache
def moe():
    """megatron-core's MoE names (``MoELayer``, ``MoESubmodules``, ``TopKRouter``, ``MegatronModule``,
    ``compute_routing_scores_for_aux_loss``) as a namespace (issue 36)."""
    import types

    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.router import TopKRouter

    return types.SimpleNamespace(MoELayer=MoELayer, MoESubmodules=MoESubmodules, TopKRouter=TopKRouter,
                                 MegatronModule=MegatronModule,
                                 compute_routing_scores_for_aux_loss=moe_utils.compute_routing_scores_for_aux_loss)
