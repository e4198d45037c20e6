"""vLLM's ``RowParallelLinear`` at TP > 1 under ``RL_KERNEL_TP_INVARIANT`` (contract ``rlk.gemm.tp.v1``).

vLLM 0.22's ``RowParallelLinear.forward`` runs the rank's GEMM through the layer's linear method — rounded to the
activation dtype, the bias fused in on TP rank 0 only — and then ``tensor_model_parallel_all_reduce`` adds the TP
ranks' rounded products: the K tree changes with TP and there are TP + 1 roundings. In invariant mode (G leaves, a
run property) an R module's row-parallel linear instead:

1. computes the rank's fp32 partial over the G / TP leaves it holds, ``linear_tp_partials(x_r, w_r, G / TP)``
   (``x_r``: the layer's input, or the rank's slice of it when ``input_is_parallel`` is false, as vLLM slices it);
2. merges the TP group's partials with ``rlk_collectives.all_reduce_partials`` — the rank tree in fp32, fp32 on the
   wire — and rounds once (``linear_tp_finish``), adding the layer's bias once, after the merge (vLLM's rank-0 bias
   is the same value added in another place: the contract adds it to the merged fp32 sum). ``skip_bias_add``
   returns the bias unadded, as vLLM does.

The result is bitwise ``linear_tp(x, w, bias, G)`` on one process, at every TP that is a power of two dividing G.

How it is installed: :class:`RlkRowParallelLinear` (built by :func:`layer_class`) replaces vLLM's class out of tree
(``PluggableLayer.register_oot``, vLLM's extension point for whole layers: every ``RowParallelLinear(...)`` vLLM
builds after ``register()`` is this subclass). Its ``forward`` is vLLM's own (``super().forward``) unless the layer
belongs to an R module at TP > 1 in invariant mode. The merge is one opaque op, ``torch.ops.rlk_vllm.
tp_all_reduce_partials`` (a fake implementation for tracing), so a compiled graph keeps it whole as it keeps vLLM's
``torch.ops.vllm.all_reduce``; the GEMM is ``torch.ops.rlk.linear_tp_partials`` there as everywhere.

What is refused (strict: raised where vLLM builds the layer; audit: logged, the layer runs vLLM's forward with
``rlk.gemm.bi.v1`` and rlk's all-reduce): a layer with ``reduce_results=False`` (its caller would reduce the rounded
output), a quantized layer, a TP that is not a power of two dividing G, a local K not divisible by G / TP.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from rlk_vllm_plugin import _compat, _runtime
from rlk_vllm_plugin.layers import _empty, _linear_module

OP = "rlk_vllm::tp_all_reduce_partials"
_CLASS: list[type] = []
_VLLM: dict[str, Any] = {}  # vLLM's objects the forward uses, resolved once (no import while a graph is traced)
_OP: list[Any] = []
_CHECKED: set[tuple[int, int]] = set()  # (pid, id(runtime)) whose first merge ran the G agreement check


def merge_op() -> Any:
    """``torch.ops.rlk_vllm.tp_all_reduce_partials(s, bias, module, leaves_total, dtype)``, defined on first use."""
    if _OP:
        return _OP[0]

    @torch.library.custom_op(OP, mutates_args=())
    def tp_all_reduce_partials(s: torch.Tensor, bias: torch.Tensor | None, module: str, leaves_total: int,
                               dtype: torch.dtype) -> torch.Tensor:
        import rlk_collectives

        rt = _runtime.get()
        group = _compat.module("vllm.distributed.parallel_state").get_tp_group()
        key = (os.getpid(), id(rt))
        check = key not in _CHECKED  # once per process: every rank's G, shape and dtype agree (then no extra round)
        with rt.recorder.scope(module):
            out = rlk_collectives.all_reduce_partials(s, group.device_group, leaves_total=leaves_total, bias=bias,
                                                      dtype=dtype, check=check)
        _CHECKED.add(key)
        return out

    @tp_all_reduce_partials.register_fake
    def _(s, bias, module, leaves_total, dtype):
        return torch.empty(s.shape, dtype=dtype, device=s.device)

    _OP.append(tp_all_reduce_partials)
    return tp_all_reduce_partials


def decide(layer: Any, rt: _runtime.Runtime) -> tuple[str, int] | None:
    """``(module, leaves per rank)`` when ``layer`` runs the TP-invariant path, else None (vLLM's forward: TP 1, where
    the linear method runs ``linear_tp`` itself; a P module; invariant mode off; or a refusal, reported here)."""
    g = rt.tp_leaves
    tp = int(getattr(layer, "tp_size", 1))
    if not g or tp == 1:
        return None
    module = _linear_module(layer)
    if not rt.r(module):
        return None
    name = getattr(layer, "prefix", "?")
    problems = []
    if not isinstance(getattr(layer, "quant_method", None), _VLLM["UnquantizedLinearMethod"]):
        problems.append(f"its linear method is {type(getattr(layer, 'quant_method', None)).__name__}, not "
                        "UnquantizedLinearMethod (rlk runs unquantized weights only)")
    if tp & (tp - 1) or g % tp:
        problems.append(f"TP {tp} is not a power of two dividing G={g}; raise RL_KERNEL_TP_INVARIANT or use such a TP")
    elif int(layer.input_size_per_partition) % (g // tp):
        problems.append(f"its local K {layer.input_size_per_partition} is not divisible by G / TP = {g // tp}")
    if not getattr(layer, "reduce_results", True):
        problems.append("reduce_results=False: its caller would all-reduce the rounded output; rlk.gemm.tp.v1 needs "
                        "the fp32 partial merged by rlk")
    if problems:
        rt.violation(f"RL_KERNEL_TP_INVARIANT={g}: row-parallel linear {name!r} at TP {tp} cannot run rlk.gemm.tp.v1: "
                     + "; ".join(problems))
        return None
    return module, g // tp


def _decision(layer: Any) -> tuple[str, int] | None:
    """:func:`decide`, kept on the layer for the runtime that decided: made when the layer is built and again at
    model load (``layers.bind_model``, through the class's ``_rlk_bind``), so a traced forward only reads it."""
    rt = _runtime.get()
    cached = layer.__dict__.get("_rlk_tp")
    if cached is not None and cached[0] is rt:
        return cached[1]
    found = decide(layer, rt)
    if not torch.compiler.is_compiling():
        layer.__dict__["_rlk_tp"] = (rt, found)
    return found


def _forward(self, input_):
    found = _decision(self)
    if found is None:
        return super(type(self), self).forward(input_)
    module, leaves = found
    if self.input_is_parallel:
        x = input_
    else:  # vLLM's own slicing of a replicated input
        x = _VLLM["split_tensor_along_last_dim"](input_, num_partitions=self.tp_size)[self.tp_rank].contiguous()
    weight = self.weight
    if _empty(weight):
        _runtime.get().violation(f"linear {self.prefix!r}: vLLM replaced the weight (CPU weight packing); rlk "
                                 "cannot run it")
        return super(type(self), self).forward(input_)
    s = _runtime.rlk(module, "linear_tp_partials", x, weight, leaves)
    bias = None if self.skip_bias_add else self.bias
    out = merge_op()(s, bias, module, leaves * self.tp_size, x.dtype)
    if not torch.compiler.is_compiling():
        _runtime.note_linear(None)  # this layer's reduction is done: a later TP all-reduce is not this module's
    if not self.return_bias:
        return out
    return out, (self.bias if self.skip_bias_add else None)


def layer_class() -> type:
    """``RlkRowParallelLinear``, a subclass of the installed vLLM's ``RowParallelLinear`` (built once)."""
    if not _CLASS:
        linear = _compat.module("vllm.model_executor.layers.linear")
        _VLLM["UnquantizedLinearMethod"] = linear.UnquantizedLinearMethod
        _VLLM["split_tensor_along_last_dim"] = _compat.module("vllm.distributed").split_tensor_along_last_dim
        base = linear.RowParallelLinear
        # _rlk_bind: rlk_vllm_plugin.layers.bind_model decides each such layer again after the model load
        ns = {"__init__": _init, "forward": _forward, "_rlk_bind": staticmethod(_decision), "__module__": __name__}
        _CLASS.append(type("RlkRowParallelLinear", (base,), ns))
    return _CLASS[0]


def _init(self, *args, **kwargs):
    super(type(self), self).__init__(*args, **kwargs)
    _decision(self)  # a refusal is raised (strict) where vLLM builds the layer


def install(probe: _compat.Probe) -> str:
    """Register :class:`RlkRowParallelLinear` for vLLM's ``RowParallelLinear`` (idempotent); returns the target."""
    custom_op = _compat.module("vllm.model_executor.custom_op")
    cls = layer_class()
    current = custom_op.op_registry_oot.get("RowParallelLinear")
    if current is not cls:
        if current is not None:
            raise RuntimeError(f"vLLM RowParallelLinear already has an out-of-tree replacement {current!r} (another "
                               "plugin); rlk cannot install its own")
        base_name = cls.__mro__[1].__dict__.get("name")
        custom_op.PluggableLayer.register_oot(_decorated_layer_cls=cls, name="RowParallelLinear")
        if base_name is not None:
            cls.name = base_name  # register_oot renames it; vLLM's own name ("row_parallel_linear") stays
    merge_op()
    return "vllm.model_executor.layers.linear.RowParallelLinear"


def uninstall() -> None:
    custom_op = _compat.module("vllm.model_executor.custom_op")
    if _CLASS and custom_op.op_registry_oot.get("RowParallelLinear") is _CLASS[0]:
        del custom_op.op_registry_oot["RowParallelLinear"]


__all__ = ["OP", "decide", "install", "layer_class", "merge_op", "uninstall"]
