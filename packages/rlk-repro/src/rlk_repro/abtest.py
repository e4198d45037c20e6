"""The operator A/B harness (``rlk-repro abtest``): fixed log-prob tensors through every implementation of the
contract, one table.

Fixed tensors (:class:`ABInputs`): hidden states ``[T, H]``, the LM-head weight ``[V, H]``, target ids, per-row
temperature, the kept set (top-k / top-p, as rlk's threshold and as a mask), the dtype policy and the TP metadata —
generated (:func:`generate_inputs`) or captured from a run (``rlk-repro attribute`` writes ``ab-tensors.safetensors``;
:func:`load_inputs`). Every implementation computes the selected token's log-prob from the same tensors:

- ``torch.native``: ``F.linear`` in the input dtype, fp32 ``/ T``, ``-inf`` outside the kept set, ``log_softmax``,
  gather (the local engine's P path; Megatron's unfused recompute);
- ``vllm.compute_logprobs``: the same logits through vLLM's own sampler log-softmax
  (``vllm.v1.sample.sampler.Sampler.compute_logprobs``), where vLLM imports;
- ``megatron.vocab_parallel_cross_entropy``: megatron-core's vocab-parallel cross-entropy at TP 1 (a gloo world of
  one rank when no process group exists), where megatron-core imports;
- ``rlk.linear_logprobs`` (fused, the train side's R path) and ``rlk.linear+token_logprobs`` (the rollout side's R
  path), each through rlk's dispatch; ``rlk.linear_logprobs@tpK``: the weight in K vocab shards (the vocab-parallel
  merge of the contract, simulated in one process);
- ``backend:<id>``: every backend registered for the op (``linear_logprobs``, or ``processed_linear_logprobs`` with a
  kept set) and available on the device — built in or plugged in through the ``rlk.backends`` entry point — called
  directly (its forward, and its ``*_backward`` op's backend of the same id where it registers one): a kernel
  author measures a kernel here before it is qualified for a route.

Per implementation: selected log-prob max / mean / p99 |error| against the fp64 reference, backward (d hidden,
d weight of ``sum(g * logp)`` for a fixed ``g``) max relative error against fp64, forward and backward run-to-run
bitwise determinism, throughput (tokens/s, median of ``repeats``) and peak memory (CUDA only); between every pair,
bitwise agreement (``torch.equal`` on the bits) of the log-probs and of the gradients.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rlk_repro._tensorio import bits, read_checked

AB_SCHEMA = "rlk.ab-report.v1"
TENSORS_SCHEMA = "rlk.ab-tensors.v1"
FRAMEWORK_IMPLS = ("vllm", "megatron")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ABInputs:
    hidden: torch.Tensor  # [T, H] in the dtype policy's input dtype
    weight: torch.Tensor  # [V, H]
    target: torch.Tensor  # [T] int64
    temperature: torch.Tensor  # [T] fp32
    kept_value: torch.Tensor | None = None  # [T] fp32: rlk's kept-set threshold (None: the whole vocabulary)
    kept_token_id: torch.Tensor | None = None  # [T] int64
    tp: tuple[int, ...] = (1,)  # vocab-parallel splits to run rlk's sharded path at (1 = unsharded)
    source: dict[str, Any] = field(default_factory=dict)

    @property
    def kept(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.kept_value is None else (self.kept_value, self.kept_token_id)

    @property
    def dtype_policy(self) -> str:
        name = str(self.hidden.dtype).replace("torch.", "")
        return f"{name} hidden and weight, logits rounded to {name}, fp32 temperature / log-softmax"

    def mask(self) -> torch.Tensor | None:
        """The kept set as a ``[T, V]`` mask, from rlk's threshold on rlk's logits (the one definition every
        implementation is given)."""
        if self.kept_value is None:
            return None
        from rlk_core.ops import apply_kept, linear

        return torch.isfinite(apply_kept(linear(self.hidden, self.weight), self.temperature, self.kept))

    def to(self, device: torch.device) -> ABInputs:
        mv = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return ABInputs(**mv)


def generate_inputs(tokens: int = 64, hidden: int = 128, vocab: int = 1000, dtype: str = "bfloat16", seed: int = 0,
                    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, logit_std: float = 4.0,
                    tp: tuple[int, ...] = (1, 2, 4, 8)) -> ABInputs:
    """Seeded inputs with a realistic logit scale (std ``logit_std``) and targets drawn from the processed
    distribution (so every target is in its kept set)."""
    from rlk_core.ops import apply_kept, kept_set, linear

    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    h = torch.randn(tokens, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * (logit_std / hidden**0.5)
    h, w = h.to(dt), w.to(dt)
    temp = torch.full((tokens,), float(temperature))
    value = token_id = None
    z = (h.double() @ w.double().T) / temperature
    if top_k > 0 or top_p < 1.0:
        ks = kept_set(linear(h, w), temp, top_k=top_k, top_p=top_p)
        value, token_id = ks.value, ks.token_id
        z = z.masked_fill(~torch.isfinite(apply_kept(linear(h, w), temp, (value, token_id))), float("-inf"))
    target = torch.multinomial(torch.softmax(z, -1), 1, generator=g).squeeze(-1)
    return ABInputs(h, w, target, temp, value, token_id, tuple(t for t in tp if _shardable(vocab, t)),
                    {"kind": "generated", "seed": seed, "tokens": tokens, "hidden": hidden, "vocab": vocab,
                     "dtype": dtype, "top_k": top_k, "top_p": top_p, "temperature": temperature})


def save_inputs(inputs: ABInputs, path: Path) -> None:
    import json

    from safetensors.torch import save_file

    t = {"hidden": inputs.hidden, "weight": inputs.weight, "target": inputs.target, "temperature": inputs.temperature}
    if inputs.kept_value is not None:
        t["kept_value"], t["kept_token_id"] = inputs.kept_value, inputs.kept_token_id
    save_file({k: v.detach().cpu().contiguous() for k, v in t.items()}, str(path),
              metadata={"schema": TENSORS_SCHEMA, "tp": ",".join(map(str, inputs.tp)),
                        "source": json.dumps(inputs.source)})


def load_inputs(path: Path) -> ABInputs:
    import json

    t, meta = read_checked(path, TENSORS_SCHEMA)
    tp = tuple(int(x) for x in meta.get("tp", "1").split(",") if x)
    return ABInputs(t["hidden"], t["weight"], t["target"], t["temperature"], t.get("kept_value"),
                    t.get("kept_token_id"), tp, {**json.loads(meta.get("source", "{}")), "file": str(path)})


def _shardable(vocab: int, tp: int) -> bool:
    """Whether ``tp`` vocab shards fall on the contract's group boundaries (8 groups of ceil(V/8) columns)."""
    return tp == 1 or (8 % tp == 0 and vocab >= 8)


def _shards(weight: torch.Tensor, tp: int) -> list[torch.Tensor]:
    v = weight.shape[0]
    gs = -(-v // 8)
    bounds = [min(g * gs, v) for g in range(0, 9, 8 // tp)]
    return [weight[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


# -- implementations -----------------------------------------------------------------------------------------------
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (hidden, weight) -> logp [T] fp32
Grads = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Impl:
    name: str
    kind: str  # native | rlk | backend
    forward: Forward
    grads: Grads | None = None  # (hidden, weight, g) -> (d hidden, d weight); None: autograd through forward
    differentiable: bool = True
    note: str = ""


def _masked_z(logits: torch.Tensor, inp: ABInputs, mask: torch.Tensor | None) -> torch.Tensor:
    z = logits.float() / inp.temperature[:, None]
    return z if mask is None else z.masked_fill(~mask, float("-inf"))


def _torch_native(inp: ABInputs, mask: torch.Tensor | None) -> Impl:
    def fwd(h, w):
        return torch.log_softmax(_masked_z(F.linear(h, w), inp, mask), -1).gather(-1, inp.target[:, None])[:, 0]
    return Impl("torch.native", "native", fwd, note="F.linear + fp32 log_softmax (local engine P, Megatron unfused)")


def _vllm(inp: ABInputs, mask: torch.Tensor | None) -> Impl:
    from vllm.v1.sample.sampler import Sampler  # the sampler's own log-softmax

    def fwd(h, w):
        logits = F.linear(h, w).to(torch.float32)
        logits = logits / inp.temperature[:, None]  # vLLM's apply_temperature (in place there)
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
        return Sampler.compute_logprobs(logits).gather(-1, inp.target[:, None])[:, 0]
    return Impl("vllm.compute_logprobs", "native", fwd, note="vLLM V1 Sampler.compute_logprobs on F.linear logits")


@contextlib.contextmanager
def _megatron_tp1() -> Iterator[None]:
    """megatron-core's model-parallel state at TP 1: in the process group there is, or a gloo world of one rank
    created (and torn down) here."""
    import tempfile

    import torch.distributed as dist
    from megatron.core import parallel_state

    created = not dist.is_initialized()
    if created:
        store = tempfile.NamedTemporaryFile(prefix="rlk-abtest-", delete=False)
        store.close()
        dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
    initialized = parallel_state.model_parallel_is_initialized()
    try:
        if not initialized:
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        if parallel_state.get_tensor_model_parallel_world_size() != 1:
            raise RuntimeError("the process runs megatron at TP > 1; the harness measures TP 1 in one process")
        yield
    finally:
        if not initialized:
            parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()
            os.unlink(store.name)


def _megatron(inp: ABInputs, mask: torch.Tensor | None) -> Impl:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    def fwd(h, w):
        z = _masked_z(F.linear(h, w), inp, mask)
        return -vocab_parallel_cross_entropy(z[:, None, :].contiguous(), inp.target[:, None])[:, 0]
    return Impl("megatron.vocab_parallel_cross_entropy", "native", fwd,
                note="megatron-core vocab_parallel_cross_entropy at TP 1 on F.linear logits")


def _rlk(inp: ABInputs) -> list[Impl]:
    from rlk_core import ops

    kept = inp.kept
    out = [Impl("rlk.linear_logprobs", "rlk", lambda h, w: ops.linear_logprobs(h, w, inp.target, inp.temperature,
                                                                            kept=kept)[0],
                note="fused, the train side's R path (dispatch-selected backend)"),
           Impl("rlk.linear+token_logprobs", "rlk",
                lambda h, w: ops.token_logprobs(ops.linear(h, w), inp.target, inp.temperature, kept=kept)[0],
                note="rlk GEMM logits then token_logprobs, the rollout side's R path")]
    for tp in inp.tp:
        if tp > 1:
            out.append(Impl(f"rlk.linear_logprobs@tp{tp}", "rlk",
                            lambda h, w, tp=tp: ops.linear_logprobs(h, _shards(w, tp), inp.target, inp.temperature,
                                                                    kept=kept)[0],
                            note=f"the weight in {tp} vocab shards, merged by the contract's tree"))
    return out


def _backends(inp: ABInputs, device: torch.device) -> list[Impl]:
    """Every backend registered for the log-prob op and available on ``device``, called directly."""
    from rlk_core.backends import REGISTRY
    from rlk_core.errors import RlkBackendError

    op = "linear_logprobs" if inp.kept is None else "processed_linear_logprobs"
    extra = () if inp.kept is None else inp.kept
    out = []
    for b in REGISTRY.backends(op):
        ok, why = REGISTRY.is_available(b, device.type)
        if not ok:
            continue
        try:
            bwd = REGISTRY.get(f"{op}_backward", b.id)
        except RlkBackendError:  # no backward registered under this id: forward only
            bwd = None

        def fwd(h, w, b=b):
            return b.fn(h, [w], inp.target, inp.temperature, *extra)[0]

        grads = None
        if bwd is not None:
            def grads(h, w, g, b=b, bwd=bwd):
                _, lse = b.fn(h, [w], inp.target, inp.temperature, *extra)
                dh, dws = bwd.fn(h, [w], inp.target, inp.temperature, *extra, lse, g, torch.zeros_like(g))
                return dh, dws[0]
        out.append(Impl(f"backend:{b.id}", "backend", fwd, grads, differentiable=bwd is not None,
                        note=f"{op} backend {b.id} ({b.origin}{', built in' if b.builtin else ''}), called directly"))
    return out


def implementations(inp: ABInputs, device: torch.device, frameworks: tuple[str, ...] = ()
                    ) -> tuple[list[Impl], list[dict[str, str]]]:
    """The implementations to run and those skipped (with the reason: not asked for, does not import)."""
    mask = inp.mask()
    impls, skipped = [_torch_native(inp, mask)], []
    for name, make in (("vllm", _vllm), ("megatron", _megatron)):
        if name not in frameworks:
            skipped.append({"impl": name, "why": f"not asked for (--with {name})"})
            continue
        try:
            impls.append(make(inp, mask))
        except ImportError as exc:
            skipped.append({"impl": name, "why": f"does not import: {exc}"})
    return impls + _rlk(inp) + _backends(inp, device), skipped


# -- measuring -----------------------------------------------------------------------------------------------------
def bit_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool | None:
    if a is None or b is None:
        return None
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def reference(inp: ABInputs, mask: torch.Tensor | None, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """The fp64 reference: log-prob and the gradients of ``sum(g * logp)``, nothing rounded."""
    h = inp.hidden.detach().double().requires_grad_(True)
    w = inp.weight.detach().double().requires_grad_(True)
    z = (h @ w.T) / inp.temperature.double()[:, None]
    if mask is not None:
        z = z.masked_fill(~mask, float("-inf"))
    logp = torch.log_softmax(z, -1).gather(-1, inp.target[:, None])[:, 0]
    dh, dw = torch.autograd.grad((logp * g.double()).sum(), (h, w))
    return {"logp": logp.detach(), "dh": dh, "dw": dw}


def _grads(impl: Impl, inp: ABInputs, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not impl.differentiable:
        return None
    if impl.grads is not None:
        return impl.grads(inp.hidden, inp.weight, g)
    h = inp.hidden.detach().clone().requires_grad_(True)
    w = inp.weight.detach().clone().requires_grad_(True)
    logp = impl.forward(h, w)
    dh, dw = torch.autograd.grad((logp * g).sum(), (h, w))
    return dh, dw


def _errors(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    d = (got.double() - ref).abs()
    both_inf = torch.isinf(got.double()) & torch.isinf(ref) & (torch.sign(got.double()) == torch.sign(ref))
    d = torch.where(both_inf, torch.zeros_like(d), d)
    finite = d[torch.isfinite(d)]
    if not finite.numel():
        return {"max": float("nan"), "mean": float("nan"), "p99": float("nan"), "nonfinite": int(d.numel())}
    q = torch.quantile(finite, 0.99) if finite.numel() > 1 else finite.max()
    return {"max": float(finite.max()), "mean": float(finite.mean()), "p99": float(q),
            "nonfinite": int(d.numel() - finite.numel())}


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def _timed(fn: Callable[[], Any], repeats: int, device: torch.device) -> tuple[float, int | None]:
    """Median seconds of ``fn`` over ``repeats`` (after one warm-up) and, on CUDA, its peak extra memory."""
    cuda = device.type == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated(device) - base) if cuda else None
    return statistics.median(times), peak


def run_ab(inp: ABInputs, frameworks: tuple[str, ...] = (), repeats: int = 5, device: str = "cpu",
           extra: list[Impl] | None = None, seed: int = 0) -> dict[str, Any]:
    """Every implementation on ``inp``: the table (one row per implementation) and the pairwise bitwise
    agreement; ``extra``: more implementations (a caller's own, e.g. a kernel under development)."""
    dev = torch.device(device)
    inp = inp.to(dev)
    stack = contextlib.ExitStack()
    with stack:
        if "megatron" in frameworks:
            try:
                stack.enter_context(_megatron_tp1())
            except ImportError:
                pass  # reported as skipped by implementations()
        impls, skipped = implementations(inp, dev, frameworks)
        impls += list(extra or [])
        mask = inp.mask()
        g = torch.randn(inp.target.shape[0], generator=torch.Generator().manual_seed(seed)).to(dev)
        ref = reference(inp, mask, g)
        results: dict[str, dict[str, Any]] = {}
        rows = []
        for impl in impls:
            with torch.no_grad():
                logp = impl.forward(inp.hidden, inp.weight)
                again = impl.forward(inp.hidden, inp.weight)
            grads = _grads(impl, inp, g)
            grads2 = _grads(impl, inp, g) if grads is not None else None
            with torch.no_grad():
                seconds, peak = _timed(lambda impl=impl: impl.forward(inp.hidden, inp.weight), repeats, dev)
            results[impl.name] = {"logp": logp, "grads": grads}
            row = {"impl": impl.name, "kind": impl.kind, "note": impl.note,
                   "logp_error": _errors(logp, ref["logp"]),
                   "forward_deterministic": bool(bit_equal(logp, again)),
                   "dhidden_max_rel": _rel(grads[0], ref["dh"]) if grads is not None else None,
                   "dweight_max_rel": _rel(grads[1], ref["dw"]) if grads is not None else None,
                   "backward_deterministic": (bool(bit_equal(grads[0], grads2[0]) and bit_equal(grads[1], grads2[1]))
                                              if grads is not None else None),
                   "tokens_per_s": round(inp.target.shape[0] / seconds, 1) if seconds > 0 else None,
                   "peak_memory_bytes": peak}
            rows.append(row)
    names = [r["impl"] for r in rows]
    pairs = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ga, gb = results[a]["grads"], results[b]["grads"]
            pairs.append({"a": a, "b": b, "logp_bitwise": bool(bit_equal(results[a]["logp"], results[b]["logp"])),
                          "grads_bitwise": (None if ga is None or gb is None else
                                            bool(bit_equal(ga[0], gb[0]) and bit_equal(ga[1], gb[1])))})
    return {"schema": AB_SCHEMA, "device": str(dev), "dtype_policy": inp.dtype_policy,
            "shape": {"tokens": int(inp.hidden.shape[0]), "hidden": int(inp.hidden.shape[1]),
                      "vocab": int(inp.weight.shape[0])},
            "kept_set": inp.kept is not None, "tp": list(inp.tp), "source": inp.source, "repeats": repeats,
            "memory": "peak extra CUDA memory per call" if dev.type == "cuda" else
            "not measured on cpu (CUDA's allocator statistics only)",
            "rows": rows, "pairs": pairs, "skipped": skipped}


def bitwise_groups(report: dict[str, Any]) -> list[list[str]]:
    """The implementations partitioned into classes whose log-probs agree bit for bit."""
    groups: list[list[str]] = []
    equal = {(p["a"], p["b"]) for p in report["pairs"] if p["logp_bitwise"]}
    for r in report["rows"]:
        for grp in groups:
            if (grp[0], r["impl"]) in equal:
                grp.append(r["impl"])
                break
        else:
            groups.append([r["impl"]])
    return groups


def _f(x: Any) -> str:
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def markdown(report: dict[str, Any], level: int = 1) -> str:
    s = report["shape"]
    lines = [f"{'#' * level} Operator A/B: selected log-prob, T={s['tokens']} H={s['hidden']} V={s['vocab']}", "",
             f"device {report['device']}; {report['dtype_policy']}; kept set: {_f(report['kept_set'])}; "
             f"memory: {report['memory']}", "",
             "| impl | group | logp max err | mean | p99 | d hidden rel | d weight rel | fwd det | bwd det | "
             "tokens/s | peak mem |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    group_of = {n: i for i, grp in enumerate(bitwise_groups(report)) for n in grp}
    for r in report["rows"]:
        e = r["logp_error"]
        lines.append(f"| {r['impl']} | {chr(65 + group_of[r['impl']])} | {_f(e['max'])} | {_f(e['mean'])} | "
                     f"{_f(e['p99'])} | {_f(r['dhidden_max_rel'])} | {_f(r['dweight_max_rel'])} | "
                     f"{_f(r['forward_deterministic'])} | {_f(r['backward_deterministic'])} | "
                     f"{_f(r['tokens_per_s'])} | "
                     f"{_f(r['peak_memory_bytes'])} |")
    lines += ["", "Errors are |logp - fp64 reference|; implementations in one group agree bit for bit on every "
              "log-prob.", ""]
    grad_pairs = [p for p in report["pairs"] if p["logp_bitwise"]]
    if grad_pairs:
        lines += ["Bitwise log-prob pairs (and their gradients):", ""]
        lines += [f"- {p['a']} == {p['b']}: gradients {_f(p['grads_bitwise'])}" for p in grad_pairs]
    for sk in report["skipped"]:
        lines.append(f"- skipped {sk['impl']}: {sk['why']}")
    return "\n".join(lines) + "\n"
