"""What a training step asks of the device, counted on the CPU (tests and benchmarks; never used in training).

- :func:`issuer`: the code a torch call is charged to — the innermost Python frame outside torch, named by
  its package (``provider`` = rlk_megatron_provider, ``rlk_core``, ``rlk_ref`` = the insides of an rlk_core
  CPU reference kernel, ``collectives``, ``megatron``, ``harness`` = anything else) with
  ``file:function:line``; ``autograd`` for ops that C++ backward formulas issue.
- :class:`OpCounter`: every top-level op a step dispatches, by issuer and op name (an rlk op counts as one:
  a ``TorchDispatchMode`` does not see inside the ops it dispatches).
- :class:`SyncCounter`: the host syncs the same step makes on a CUDA device — each op that makes the host
  wait for the GPU, with its issuer.

**Which ops sync** (on CUDA; torch's ``set_sync_debug_mode`` instruments the same places, and like it this
list is not exhaustive — the GPU benchmark counts the real ones): a read of a device value on the host
(``_local_scalar_dense``: ``.item()``, ``int()``, ``float()``, ``bool()``, ``if t:``; ``.tolist()``,
``.cpu()``, ``.to("cpu")``, ``.numpy()``); a copy between host and device (``torch.tensor(data,
device=...)``, ``.to(device)`` / ``.cuda()`` of a host tensor, ``copy_`` across the two — blocking, or from
pageable memory; only ``non_blocking=True`` from pinned memory is exempt, which a CPU run cannot make); an op
whose output size depends on device data (``nonzero``, ``argwhere``, ``masked_select``, boolean-mask
indexing and assignment, ``repeat_interleave`` without ``output_size``, ``unique*``, ``bincount``,
``histc``, ``multinomial``) or whose result is a host value (``equal``, ``is_nonzero``, ``allclose``);
``masked_fill`` with a device tensor as the value.

**The device model** (on the CPU every tensor is a host tensor; the count must be the GPU's). A tensor is a
*device tensor* — one the GPU run holds on the GPU — unless it is a *host tensor*, and it is a host tensor
only if, under the counter:

1. it was made by a factory (``torch.tensor``, ``arange``, ``zeros``, ``full`` ...) called without a
   ``device=`` argument, or with the string ``"cpu"`` (code that builds a tensor for the device names the
   device, which it takes from a tensor, ``x.device``, or from its config), or it is an RNG state
   (``torch.get_rng_state``, ``torch.cuda.get_rng_state``: host tensors on the GPU too);
2. it came back from an explicit move to the host: ``.cpu()``, ``.to("cpu")`` (the string), ``.numpy()``;
3. it is the output of an op whose tensor inputs are all host tensors (views, arithmetic, ``cumsum`` ...).

Every other tensor is a device tensor: those the counter did not see being made (the model's parameters and
buffers, the step's batch, caches built before it), the outputs of ops with a device tensor among their
inputs, factories with ``device=`` a ``torch.device`` (or ``"cuda"``), moves ``.to(<torch.device>)`` /
``.cuda()``. A sync is counted where its operand is a device tensor (or, for copies, where they cross).
So cu_seqlens the caller keeps on the CPU (``torch.tensor(lens)``) are read for free, and the same values
made with ``device=q.device`` cost a copy. Limits: code that names the host as ``torch.device("cpu")``
(an object, not the string) is taken to mean the device; code that branches on ``x.device`` sees the CPU
(e.g. an ``if idx.device != w.device: idx = idx.to(w.device)`` never runs), so the steady state after such a
move is what is modelled; ops inside an rlk op are not seen (on the GPU they are one kernel: a sync inside
rlk_core is found by reading it, or by the GPU count).
"""

from __future__ import annotations

import collections
import os
import sys
from dataclasses import dataclass

OWNERS = {"rlk_megatron_provider": "provider", "rlk_core": "rlk_core", "rlk_collectives": "collectives",
          "megatron": "megatron", "torch": None}
REFERENCE_MODULES = ("rlk_core.ops._fixed", "rlk_core.ops._logp_tree")


def owner_of(frame) -> str | None:
    """The issuer name of one frame's module, or None for torch's own frames (and generated code)."""
    if frame.f_code.co_filename.startswith("<"):
        return None
    module = frame.f_globals.get("__name__", "") or ""
    if module == __name__:
        return None  # the counters' own frames
    top = module.partition(".")[0]
    if top == "rlk_core" and (module.endswith(".reference") or module in REFERENCE_MODULES):
        return "rlk_ref"  # a CPU reference kernel's insides: one Triton / CUDA kernel on the GPU instead
    return OWNERS.get(top, "harness")


def issuer(frame) -> tuple[str, str | None]:
    """``(owner, "file:function:line")`` of the innermost frame at or above ``frame`` outside torch;
    ``("autograd", None)`` when the walk reaches the autograd engine first (a C++ backward formula)."""
    while frame is not None:
        if frame.f_code.co_name == "_engine_run_backward":
            return "autograd", None
        owner = owner_of(frame)
        if owner is not None:
            return owner, f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}:{frame.f_lineno}"
        frame = frame.f_back
    return "harness", None


# ops that launch no kernel: views and metadata (``alias``/``detach``), and allocations (no kernel, the allocator)
VIEWS = frozenset("view _unsafe_view alias t transpose permute slice select split split_with_sizes unsqueeze "
                  "squeeze expand as_strided detach narrow unbind view_as _reshape_alias lift_fresh".split())
ALLOCS = frozenset("empty new_empty empty_strided empty_like new_empty_strided".split())


def kind(op: str) -> str:
    """``"ns::name"`` -> ``rlk`` (an rlk op), ``view``, ``alloc`` or ``kernel`` (a torch op that launches work)."""
    ns, _, name = op.partition("::")
    if ns == "rlk":
        return "rlk"
    return "view" if name in VIEWS else "alloc" if name in ALLOCS else "kernel"


def _op_name(func) -> tuple[str, str]:
    ns = getattr(func, "namespace", "aten")
    packet = getattr(func, "overloadpacket", None)
    return ns, str(packet.__name__) if packet is not None else str(func)


class OpCounter:
    """A dispatch mode counting top-level ops by ``(owner, "ns::op")`` (:attr:`counts`) and, for the
    provider and rlk_core, by ``(owner, site, "ns::op")`` (:attr:`where`)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = collections.Counter()
        where = self.where = collections.Counter()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                owner, site = issuer(sys._getframe(1))
                ns, name = _op_name(func)
                counts[(owner, f"{ns}::{name}")] += 1
                if owner in ("provider", "rlk_core"):
                    where[(owner, site, f"{ns}::{name}")] += 1
                return func(*args, **(kwargs or {}))

        self._mode_cls = Mode

    def __enter__(self):
        self._mode = self._mode_cls()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


@dataclass(frozen=True)
class Sync:
    """One host sync: what kind, which op, who issued it and where."""

    kind: str  # "read" (a device value to the host), "d2h", "h2d", "shape" (data-dependent size), "host value"
    op: str
    owner: str
    site: str | None


# dispatch-level ops that sync when a tensor operand is a device tensor
_SHAPE_OPS = frozenset("nonzero nonzero_numpy argwhere masked_select _unique _unique2 unique_dim unique_consecutive "
                       "unique_dim_consecutive bincount histc multinomial".split())
_HOST_VALUE_OPS = frozenset("equal is_nonzero allclose".split())
_INDEX_OPS = frozenset("index index_put index_put_ _index_put_impl_".split())
# functions that return host tensors made in C++ (no factory the counter sees): wrapped while it counts
HOST_RESULT_FUNCTIONS = (("torch", "get_rng_state"), ("torch.random", "get_rng_state"),
                         ("torch.cuda", "get_rng_state"), ("torch.cuda.random", "get_rng_state"))
_MOVING_OPS = _INDEX_OPS | {"copy_"}  # a host operand of these is a copy (counted), not a device mix-up
FACTORY_NAMES = ("tensor as_tensor asarray arange range zeros ones full empty empty_strided eye linspace logspace "
                 "rand randn randint randperm scalar_tensor tril_indices triu_indices").split()
_DATA_FACTORIES = ("tensor", "as_tensor", "asarray")  # from Python data: a copy to the device when one is named


class SyncCounter:
    """Counts the host syncs of the code run under it, as on a CUDA device (see the module docstring for the
    ops and the device model). :attr:`syncs` lists them in order; :meth:`by_owner`, :meth:`by_site`
    summarise. ``mixed`` counts ops that take a host and a device tensor of more than one element (an error
    on the GPU, or a copy the model cannot see)."""

    def __init__(self) -> None:
        import torch
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.weak import WeakIdKeyDictionary

        self.syncs: list[Sync] = []
        self.mixed: collections.Counter = collections.Counter()
        self._host = WeakIdKeyDictionary()
        counter = self
        T = torch.Tensor
        factories = {getattr(torch, n): n for n in FACTORY_NAMES if hasattr(torch, n)}
        new_factories = {T.new_tensor: "new_tensor", T.new_zeros: "new_zeros", T.new_ones: "new_ones",
                         T.new_full: "new_full", T.new_empty: "new_empty"}

        class Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func is T.backward:
                    return _backward_under(self, *args, **kwargs)
                frame = sys._getframe(1)
                if func is T.tolist:
                    counter._read(args[0], "d2h", "tolist", frame)
                    return func(*args, **kwargs)
                if func in (T.cpu, T.numpy):
                    counter._read(args[0], "d2h", func.__name__, frame)
                    return counter._moved(args[0], func(*args, **kwargs), host=True)
                if func is T.to:
                    return counter._to(func, args, kwargs, frame)
                if func is T.__getitem__ or func is T.__setitem__:  # a host index into a device tensor moves
                    counter._host_index(args, frame)
                if func is T.cuda:
                    counter._upload(args[0], kwargs, "cuda", frame)
                    return counter._moved(args[0], func(*args, **kwargs), host=False)
                name = factories.get(func) or new_factories.get(func)
                if name is None:
                    return func(*args, **kwargs)
                out = func(*args, **kwargs)
                if func in new_factories and "device" not in kwargs:
                    host = counter.is_host(args[0])
                else:
                    host = _names_host(kwargs.get("device"))
                data = args[1 if name == "new_tensor" else 0] if len(args) > (name == "new_tensor") else None
                from_host = counter.is_host(data) if _is_tensor(data) else True
                if not host and from_host and (name in _DATA_FACTORIES or name == "new_tensor"):
                    counter._record("h2d", f"{name}(data, device=...)", frame)
                return counter._place(out, host)

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                counter._dispatch_sync(func, args, kwargs)
                out = func(*args, **kwargs)
                ins = [t for t in _tensors((args, kwargs))]
                if ins and all(counter.is_host(t) for t in ins):
                    for t in _tensors(out):
                        counter._host[t] = True
                elif ins and _op_name(func)[1] not in _MOVING_OPS:
                    big_host = [t for t in ins if counter.is_host(t) and t.dim() > 0 and t.numel() > 1]
                    if big_host:
                        counter.mixed[(_op_name(func)[1], issuer(sys._getframe(1))[1])] += 1
                        for t in _tensors(out):
                            counter._host.pop(t, None)
                return out

        self._modes = (Functions, Dispatch)

    # -- the device model
    def is_host(self, t) -> bool:
        return t in self._host

    def declare_host(self, *tensors) -> SyncCounter:
        """Tensors made before the counter that the GPU run keeps on the host too (e.g. a torch optimizer's
        ``step`` counters, host tensors unless it is capturable or fused)."""
        self._place(list(tensors), host=True)
        return self

    def _place(self, out, host: bool):
        for t in _tensors(out):
            if host:
                self._host[t] = True
            else:
                self._host.pop(t, None)
        return out

    def _moved(self, x, out, host: bool):
        """The result of a move of ``x`` to the host / the device. On the CPU a move to where a tensor already
        is returns the tensor itself; where the model places it elsewhere, a view stands for the GPU's copy
        (so ``x`` keeps its own placement)."""
        if out is x and self.is_host(x) != host:
            out = x.view_as(x)
        return self._place(out, host)

    # -- recording
    def _record(self, kind: str, op: str, frame) -> None:
        owner, site = issuer(frame)
        self.syncs.append(Sync(kind, op, owner, site))

    def _read(self, t, kind: str, op: str, frame) -> None:
        if not self.is_host(t):
            self._record(kind, op, frame)

    def _upload(self, t, kwargs: dict, op: str, frame) -> None:
        if self.is_host(t) and not (kwargs.get("non_blocking") and t.is_pinned()):
            self._record("h2d", op, frame)

    def _host_index(self, args, frame) -> None:
        x, index = args[0], args[1]
        if self.is_host(x):
            return
        parts = index if isinstance(index, tuple) else (index,)
        if any(_is_tensor(i) and self.is_host(i) and i.dtype not in _mask_dtypes() for i in parts):
            self._record("h2d", "index with a host tensor", frame)

    def _to(self, func, args, kwargs, frame):
        import torch

        x, rest = args[0], args[1:]
        target = kwargs.get("device", None)
        if target is None:
            for a in rest:
                if isinstance(a, (str, int, torch.device)) or _is_tensor(a):
                    target = a
                    break
        out = func(*args, **kwargs)
        if target is None:  # a dtype / memory-format change: stays where it is
            return out
        host = self.is_host(target) if _is_tensor(target) else _names_host(target)
        if host:
            self._read(x, "d2h", "to(host)", frame)
        else:
            self._upload(x, kwargs, "to(device)", frame)
        return self._moved(x, out, host)

    def _dispatch_sync(self, func, args, kwargs) -> None:
        ns, name = _op_name(func)
        if ns != "aten":
            return
        kind = None
        operands = list(_tensors((args, kwargs)))
        on_device = any(not self.is_host(t) for t in operands)
        if name == "_local_scalar_dense":
            kind = "read" if on_device else None
        elif name in _SHAPE_OPS:
            kind = "shape" if on_device else None
        elif name in _HOST_VALUE_OPS:
            kind = "host value" if on_device else None
        elif name == "repeat_interleave":
            kind = "shape" if on_device and kwargs.get("output_size", args[3] if len(args) > 3 else None) is None \
                else None
        elif name in _INDEX_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            masks = [t for t in indices if _is_tensor(t) and t.dtype in _mask_dtypes()]
            kind = "shape" if masks and on_device else None
        elif name in ("masked_fill", "masked_fill_"):
            value = args[2] if len(args) > 2 else kwargs.get("value")
            kind = "read" if _is_tensor(value) and not self.is_host(value) else None
        elif name == "copy_":
            dst, src = args[0], args[1]
            if self.is_host(dst) != self.is_host(src):
                kind = "d2h" if self.is_host(dst) else "h2d"
                if kind == "h2d" and kwargs.get("non_blocking", args[2] if len(args) > 2 else False) \
                        and src.is_pinned():
                    kind = None
        if kind is not None:
            self._record(kind, f"aten::{name}", sys._getframe(2))

    # -- results
    def gpu_path(self) -> list[Sync]:
        """The syncs the GPU run makes too: all but those in rlk_core's CPU reference code (``rlk_ref``: on the
        GPU a kernel runs instead, e.g. a reference backward's constant upload)."""
        return [s for s in self.syncs if s.owner != "rlk_ref"]

    def by_owner(self) -> dict[str, int]:
        return dict(collections.Counter(s.owner for s in self.syncs))

    def by_site(self, syncs: list[Sync] | None = None) -> dict[str, int]:
        """``"owner site op (kind)"`` -> count, most frequent first (of ``syncs``, default all)."""
        c = collections.Counter(f"{s.owner} {s.site} {s.op} ({s.kind})" for s in (self.syncs if syncs is None
                                                                                   else syncs))
        return dict(c.most_common())

    def __enter__(self):
        import importlib

        self._patched = []
        for module_name, attr in HOST_RESULT_FUNCTIONS:
            module = importlib.import_module(module_name)
            original = getattr(module, attr)
            self._patched.append((module, attr, original))
            setattr(module, attr, self._host_result(original))
        self._active = [m() for m in self._modes]
        for m in self._active:
            m.__enter__()
        return self

    def __exit__(self, *exc):
        for m in reversed(self._active):
            m.__exit__(*exc)
        for module, attr, original in reversed(self._patched):
            setattr(module, attr, original)

    def _host_result(self, fn):
        def wrapper(*args, **kwargs):
            return self._place(fn(*args, **kwargs), host=True)

        return wrapper


def _backward_under(mode, tensor, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    """``tensor.backward(...)`` with the function ``mode`` active inside every backward node (the autograd
    engine runs nodes without the caller's torch-function modes, unlike its dispatch modes): a pre-hook on
    each node of the graph pushes it, a post-hook pops it, both removed afterwards."""
    import torch

    handles, seen = [], set()
    stack = [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        handles.append(node.register_prehook(lambda grads: mode.__enter__() and None))
        handles.append(node.register_hook(lambda grads_in, grads_out: mode.__exit__(None, None, None)))
        stack.extend(n for n, _ in node.next_functions)
    try:
        torch.autograd.backward(tensor, gradient, retain_graph, create_graph, inputs=inputs)
    finally:
        for h in handles:
            h.remove()


def _is_tensor(x) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def _mask_dtypes():
    import torch

    return (torch.bool, torch.uint8)


def _names_host(device) -> bool:
    """A ``device=`` argument that names the host: absent, or the string ``"cpu"`` (see the device model)."""
    return device is None or (isinstance(device, str) and device.split(":")[0] == "cpu")


def _tensors(tree):
    import torch

    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
