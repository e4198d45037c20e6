"""``kept_set``: the kept set of top-k / top-p / min-p sampling as one threshold per row, contract
``rlk.logp.processed.v1`` (``docs/ops/kept_set.md``), and :func:`apply_kept` (op ``apply_kept``, the kept set's
companion), the processed logits a sampler draws from. The processed log-probs themselves are ``token_logprobs`` /
``linear_logprobs`` with ``kept=``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rlk_core.backends import REGISTRY, Backend
from rlk_core.ops import _checks as C
from rlk_core.ops import _logp_tree as L
from rlk_core.ops._dispatch import define
from rlk_core.ops._plan import triton_backend
from rlk_core.ops.kept_set.reference import PATH_ALL, choose_path, in_kept, kept_set_reference, mask_outside, tempered

OP = "kept_set"
APPLY = "apply_kept"  # the processed logits of a kept set: its companion op (same contract)


class KeptSet(NamedTuple):
    """A kept set per row: its last token in the contract's order ``(value, token_id)`` and its size. A token
    ``v`` is kept iff ``z_v > value or (z_v == value and v <= token_id)``, ``z = f32(logits) / f32(T)``."""

    value: torch.Tensor  # float32 [T]
    token_id: torch.Tensor  # int64 [T]
    size: torch.Tensor | None = None  # int64 [T]; not needed to apply the set


def _check(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, path: int, kmax: int) -> None:
    C.float_tensor(logits, OP, "logits")
    C.ndim(logits, OP, "logits", (2,))
    t, vocab = logits.shape
    C.require(vocab > 0, OP, "the vocabulary is empty")
    L.check_temperature(OP, t, temperature)
    for name, x, dtype in (("top_k", top_k, torch.int64), ("top_p", top_p, torch.float32),
                           ("min_p", min_p, torch.float32)):
        C.require(isinstance(x, torch.Tensor) and x.dtype == dtype and tuple(x.shape) == (t,), OP,
                  f"{name} must be a {dtype} tensor of shape ({t},) here (the public function converts numbers)")
    C.same_device(OP, logits=logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    C.require(path in (0, 1, 2, 3) and kmax >= 0, OP, f"bad path {path} / kmax {kmax}")


@define(OP)
def _kept_set(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              min_p: torch.Tensor, path: int, kmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(logits, temperature, top_k, top_p, min_p, path, kmax)


@_kept_set.register_fake
def _(logits, temperature, top_k, top_p, min_p, path, kmax):
    _check(logits, temperature, top_k, top_p, min_p, path, kmax)
    t = logits.shape[0]
    return (logits.new_empty((t,), dtype=torch.float32), logits.new_empty((t,), dtype=torch.int64),
            logits.new_empty((t,), dtype=torch.int64))


def _per_row(name: str, x, t: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, list]:
    """A number or a ``[T]`` sequence / tensor -> (the device tensor, its host values)."""
    if isinstance(x, torch.Tensor):
        C.require(x.dim() == 0 or tuple(x.shape) == (t,), OP,
                  f"{name} must be a number, a 0-d tensor or shape ({t},), got {tuple(x.shape)}")
        host = x.detach().to("cpu").expand(t).tolist()  # a CUDA tensor costs a sync here: pass host values
    elif isinstance(x, (int, float)):
        host = [x] * t
    else:
        host = list(x)
        C.require(len(host) == t, OP, f"{name} has {len(host)} values for {t} rows")
    return torch.tensor(host, dtype=dtype).to(device, non_blocking=True), host


def check_params(top_k: list, top_p: list, min_p: list) -> None:
    """Host values of the sampling parameters: ``top_k >= 0`` (0 or >= V: off; vLLM's -1 is taken as off),
    ``0 < top_p <= 1``, ``0 <= min_p <= 1``."""
    for i, (k, p, m) in enumerate(zip(top_k, top_p, min_p, strict=True)):
        C.require(k == -1 or k >= 0, OP, f"row {i}: top_k must be >= 0 (0 = off), got {k}")
        C.require(0.0 < p <= 1.0, OP, f"row {i}: top_p must be in (0, 1], got {p}")
        C.require(0.0 <= m <= 1.0, OP, f"row {i}: min_p must be in [0, 1], got {m}")


def kept_set(logits: torch.Tensor, temperature: float | torch.Tensor, top_k=0, top_p=1.0, min_p=0.0,
             host: tuple[list, list, list] | None = None) -> KeptSet:
    """The kept set of each row under top-k / top-p / min-p sampling (contract ``rlk.logp.processed.v1``).

    Parameters
    ----------
    logits : Tensor ``[T, V]`` float32 / bfloat16 / float16, the whole vocabulary of each row.
    temperature : float > 0 or ``[T]``.
    top_k, top_p, min_p : numbers or ``[T]`` per row (host lists, CPU tensors, or device tensors — these cost a
        sync to read unless ``host`` gives their values): ``top_k`` 0 or >= V (or -1) is off, ``top_p`` 1 is off,
        ``min_p`` 0 is off.
    host : optional ``(top_k, top_p, min_p)`` host lists equal to the device tensors given (a sampler that keeps
        both): checked and used to choose the path, so nothing is read back from the device.

    Returns
    -------
    :class:`KeptSet` ``(value fp32 [T], token_id int64 [T], size int64 [T])``. With
    ``z = f32(logits) / f32(T)`` ordered by value descending, ties by id ascending, min-p keeps
    ``z >= z_max + log(min_p)``, top-k the first k, top-p (over what those keep) the shortest prefix whose mass —
    summed in the contract's fixed two-level order — reaches ``top_p`` of the mass; the kept set is the first
    ``size`` tokens and ``(value, token_id)`` its last one (``(-inf, V - 1)`` for the whole vocabulary). A row's
    result depends only on that row, on any device.
    """
    C.require(isinstance(logits, torch.Tensor) and logits.dim() == 2, OP,
              f"logits must be a tensor [T, V], got {getattr(logits, 'shape', type(logits).__name__)}")
    t, vocab = logits.shape
    temp = L.as_temperature(OP, temperature, t, logits.device)
    if host is not None:
        k_host, p_host, m_host = (list(x) for x in host)
        C.require(len(k_host) == len(p_host) == len(m_host) == t, OP, f"host values must have {t} rows each")
        k, p, m = (x.to(device=logits.device, dtype=d) for x, d in
                   ((top_k, torch.int64), (top_p, torch.float32), (min_p, torch.float32)))
    else:
        k, k_host = _per_row("top_k", top_k, t, torch.int64, logits.device)
        p, p_host = _per_row("top_p", top_p, t, torch.float32, logits.device)
        m, m_host = _per_row("min_p", min_p, t, torch.float32, logits.device)
    check_params(k_host, p_host, m_host)
    k = torch.where(k < 0, torch.zeros_like(k), k)
    path, kmax = choose_path(vocab, [int(x) for x in k_host], p_host, m_host)
    return KeptSet(*_kept_set(logits, temp, k, p, m, path, kmax))


def as_kept(op: str, kept, t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A :class:`KeptSet` or ``(value, token_id)`` -> the two ``[T]`` tensors (fp32, int64) on ``device``."""
    C.require(isinstance(kept, tuple) and len(kept) >= 2, op,
              "kept must be a KeptSet or a (value [T] float32, token_id [T] int64) pair")
    value, token_id = kept[0], kept[1]
    C.require(isinstance(value, torch.Tensor) and isinstance(token_id, torch.Tensor), op,
              "kept = (value, token_id) must be tensors")
    C.require(value.dtype == torch.float32 and tuple(value.shape) == (t,), op,
              f"kept.value must be float32 of shape ({t},), got {value.dtype} {tuple(value.shape)}")
    C.int_tensor(token_id, op, "kept.token_id")
    C.require(tuple(token_id.shape) == (t,), op, f"kept.token_id must have shape ({t},), got {tuple(token_id.shape)}")
    C.same_device(op, kept_value=value, kept_token_id=token_id)
    C.require(value.device == device, op, f"kept is on {value.device}, the rows on {device}")
    return value.contiguous(), token_id.to(torch.int64).contiguous()


def _check_apply(logits: torch.Tensor, temperature: torch.Tensor, value: torch.Tensor, token_id: torch.Tensor) -> None:
    C.float_tensor(logits, APPLY, "logits")
    C.ndim(logits, APPLY, "logits", (2,))
    t = logits.shape[0]
    L.check_temperature(APPLY, t, temperature)
    C.require(value.dtype == torch.float32 and tuple(value.shape) == (t,), APPLY,
              f"value must be float32 of shape ({t},), got {value.dtype} {tuple(value.shape)}")
    C.require(token_id.dtype == torch.int64 and tuple(token_id.shape) == (t,), APPLY,
              f"token_id must be int64 of shape ({t},), got {token_id.dtype} {tuple(token_id.shape)}")
    C.same_device(APPLY, logits=logits, temperature=temperature, value=value, token_id=token_id)


@define(APPLY)
def _apply_kept(logits: torch.Tensor, temperature: torch.Tensor, value: torch.Tensor,
                token_id: torch.Tensor) -> torch.Tensor:
    _check_apply(logits, temperature, value, token_id)


@_apply_kept.register_fake
def _(logits, temperature, value, token_id):
    _check_apply(logits, temperature, value, token_id)
    return logits.new_empty(tuple(logits.shape), dtype=torch.float32)


def apply_kept(logits: torch.Tensor, temperature: float | torch.Tensor, kept) -> torch.Tensor:
    """``z = f32(logits) / f32(T)`` where the token is in the kept set, ``-inf`` elsewhere (fp32 ``[T, V]``): the
    processed logits to sample from (op ``apply_kept``, contract ``rlk.logp.processed.v1``: one IEEE division and
    two compares per element, so every backend gives the reference's bits). ``kept``: a :class:`KeptSet` or
    ``(value, token_id)``."""
    C.require(isinstance(logits, torch.Tensor) and logits.dim() == 2, APPLY,
              f"logits must be a tensor [T, V], got {getattr(logits, 'shape', type(logits).__name__)}")
    t = logits.shape[0]
    temp = L.as_temperature(APPLY, temperature, t, logits.device)
    value, token_id = as_kept(APPLY, kept, t, logits.device)
    return _apply_kept(logits, temp, value, token_id)


def apply_kept_reference(logits: torch.Tensor, temperature: torch.Tensor, value: torch.Tensor,
                         token_id: torch.Tensor) -> torch.Tensor:
    return mask_outside(tempered(logits, temperature), value, token_id)


def kept_mask(logits: torch.Tensor, temperature: float | torch.Tensor, kept, col_start: int = 0) -> torch.Tensor:
    """``[T, w]`` bool: which columns of ``logits`` (global ids from ``col_start``) lie in the kept set."""
    t = logits.shape[0]
    temp = L.as_temperature("kept_mask", temperature, t, logits.device)
    value, token_id = as_kept("kept_mask", kept, t, logits.device)
    return in_kept(tempered(logits, temp), value, token_id, col_start)


REGISTRY.register(Backend("rlk.reference", OP, kept_set_reference, devices=("cpu", "cuda"), builtin=True))
# rlk.triton only (Triton's JIT): no AOT family yet, so rlk.cuda has no kept_set and the JIT backend is the GPU's
REGISTRY.register(triton_backend(OP, "rlk_core.ops.kept_set.triton:kept_set"))
REGISTRY.register(Backend("rlk.reference", APPLY, apply_kept_reference, devices=("cpu", "cuda"), builtin=True))
REGISTRY.register(triton_backend(APPLY, "rlk_core.ops.kept_set.triton:apply_kept"))

__all__ = ["PATH_ALL", "KeptSet", "apply_kept", "as_kept", "kept_mask", "kept_set"]
