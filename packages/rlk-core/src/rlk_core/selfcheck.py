"""``rlk-selfcheck``: run each op's contract checks on the available device and report.

Prints a table (op, backend, contract id, each invariance pass/fail) and writes JSON
(``rlk.selfcheck.v1``) with ``--json``. Exit status 0 when every check passed, 1 otherwise,
2 for bad arguments. Usage: ``rlk-selfcheck [--device cpu|cuda] [--json PATH] [--seed N]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlk_core.backends import REGISTRY
from rlk_core.contracts import OP_CONTRACTS
from rlk_core.testing.compare import dtype_tols
from rlk_core.testing.invariance import check_batch_invariance, check_run_to_run

SCHEMA = "rlk.selfcheck.v1"
Check = Callable[[str, torch.Generator], dict[str, tuple[bool, str]]]


def _row_checks(op: str, fn: Callable[..., torch.Tensor], reference: Callable[..., torch.Tensor], rows: Any,
                sizes=(1, 2, 3, 7, 16, 33, 64)) -> dict[str, tuple[bool, str]]:
    args = rows if isinstance(rows, tuple) else (rows,)
    checks = {
        "batch_invariance": check_batch_invariance(fn, rows, sizes),
        "run_to_run": check_run_to_run(lambda: fn(*args), repeats=10),
    }
    device = args[0].device.type
    if REGISTRY.candidates(op, device)[0].id != "rlk.reference":  # comparing the reference with itself proves nothing
        got, want = fn(*args), reference(*args)
        # Two valid fp32 summation orders differ per element by ~sqrt(K)*eps*sum|x*w|, which an
        # elementwise atol cannot bound near zero; compare ||got - want|| / ||want|| with the dtype's rtol.
        rtol = dtype_tols(got.dtype)["rtol"]
        rel = float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))
        checks["matches_reference"] = (rel <= rtol, f"relative error {rel:.3g} vs rlk.reference (rtol {rtol})")
    return checks


def _randn(gen: torch.Generator, device: str, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def _check_linear(device: str, gen: torch.Generator) -> dict[str, tuple[bool, str]]:
    import rlk_core.ops as ops

    out: dict[str, tuple[bool, str]] = {}
    ref = REGISTRY.get("linear", "rlk.reference").fn
    for dtype in (torch.float32, torch.bfloat16):
        x, w = _randn(gen, device, dtype, 64, 512), _randn(gen, device, dtype, 96, 512)
        fn = lambda a, w=w: ops.linear(a, w)  # noqa: E731
        want = lambda a, w=w: ref(a, w, None)  # noqa: E731
        for name, res in _row_checks("linear", fn, want, x).items():
            out[f"{name}[{str(dtype)[6:]}]"] = res
    return out


def _check_rms_norm(device: str, gen: torch.Generator) -> dict[str, tuple[bool, str]]:
    import rlk_core.ops as ops

    x, w = _randn(gen, device, torch.bfloat16, 64, 1024), _randn(gen, device, torch.bfloat16, 1024)
    ref = REGISTRY.get("rms_norm", "rlk.reference").fn
    return _row_checks("rms_norm", lambda a: ops.rms_norm(a, w), lambda a: ref(a, w, 1e-6), x)


def _check_swiglu(device: str, gen: torch.Generator) -> dict[str, tuple[bool, str]]:
    import rlk_core.ops as ops

    x = _randn(gen, device, torch.bfloat16, 64, 2 * 1000)
    return _row_checks("swiglu", ops.swiglu, REGISTRY.get("swiglu", "rlk.reference").fn, x)


def _check_rope(device: str, gen: torch.Generator) -> dict[str, tuple[bool, str]]:
    import rlk_core.ops as ops

    x = _randn(gen, device, torch.bfloat16, 64, 4, 128)
    pos = torch.randint(0, 32768, (64,), generator=gen).to(device)
    ref = REGISTRY.get("rope", "rlk.reference").fn
    checks = _row_checks("rope", lambda a, p: ops.rope(a, p, 1e6), lambda a, p: ref(a, p, 1e6, 128), (x, pos))
    full = ops.rope(x, torch.arange(64, device=device), 1e6)
    part = ops.rope(x[40:], torch.arange(40, 64, device=device), 1e6)
    checks["offset_invariance"] = (bool(torch.equal(part, full[40:])), "chunk starting at position 40 vs full")
    return checks


def _check_attention(device: str, gen: torch.Generator) -> dict[str, tuple[bool, str]]:
    import rlk_core.ops as ops
    from rlk_core.testing.attention import check_cp_sharding, check_prefill_chunked_decode, cu_seqlens

    length, hq, hkv, d = 150, 4, 2, 64
    q = _randn(gen, device, torch.bfloat16, length, hq, d)
    k = _randn(gen, device, torch.bfloat16, length, hkv, d)
    v = _randn(gen, device, torch.bfloat16, length, hkv, d)
    scale = d**-0.5
    checks = {
        "prefill_chunked_decode": check_prefill_chunked_decode(q, k, v, scale, generator=gen),
        "cp_sharding": check_cp_sharding(q, k, v, scale),
    }
    # batch composition: the sequence alone vs packed between the two halves of another sequence set
    oq, ok_, ov = (_randn(gen, device, torch.bfloat16, 77, h, d) for h in (hq, hkv, hkv))
    cu1, cu3 = cu_seqlens([length], device), cu_seqlens([33, length, 77 - 33], device)
    alone = ops.attention_varlen(q, k, v, cu1, cu1, scale)
    packed = ops.attention_varlen(*(torch.cat([o[:33], t, o[33:]]) for o, t in ((oq, q), (ok_, k), (ov, v))),
                                  cu3, cu3, scale)[33 : 33 + length]
    checks["batch_composition"] = (bool(torch.equal(packed, alone)), "one sequence alone vs packed between others")
    checks["run_to_run"] = check_run_to_run(lambda: ops.attention_varlen(q, k, v, cu1, cu1, scale), repeats=5)
    grad = _randn(gen, device, torch.bfloat16, length, hq, d)

    def grads() -> tuple[torch.Tensor, ...]:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(ops.attention_varlen(*leaves, cu1, cu1, scale), leaves, grad)

    checks["backward_run_to_run"] = check_run_to_run(grads, repeats=3)
    return checks


def _check_logp(device: str, gen: torch.Generator) -> dict[str, tuple[bool, str]]:
    import rlk_core.ops as ops
    from rlk_core.testing.logp import (
        check_fused_equals_unfused,
        check_linear_vocab_shard_merge,
        check_vocab_shard_merge,
    )

    t, h, vocab = 64, 256, 8 * 520
    hidden = _randn(gen, device, torch.bfloat16, t, h)
    weight = (_randn(gen, device, torch.float32, vocab, h) / h**0.5).to(torch.bfloat16)
    target = torch.randint(0, vocab, (t,), generator=gen).to(device)
    logits = ops.linear(hidden, weight)
    return {
        "batch_invariance": check_batch_invariance(lambda x, y: ops.token_logprobs(x, y, 0.7)[0], (logits, target)),
        "batch_invariance_fused": check_batch_invariance(
            lambda x, y: ops.linear_logprobs(x, weight, y, 0.7)[0], (hidden, target), (1, 2, 7, 33, 64)),
        "vocab_shards_1_2_4_8": check_vocab_shard_merge(logits, target, 0.7),
        "vocab_shards_fused": check_linear_vocab_shard_merge(hidden, weight, target, 0.7),
        "fused_equals_unfused": check_fused_equals_unfused(hidden, weight, target, 0.7),
        "run_to_run": check_run_to_run(lambda: ops.linear_logprobs(hidden, weight, target, 0.7), repeats=3),
        "backward_run_to_run": check_run_to_run(lambda: _logp_grads(hidden, weight, target), repeats=3),
    }


def _logp_grads(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, ...]:
    import rlk_core.ops as ops

    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    logp, lse = ops.linear_logprobs(h, w, target, 0.7)
    return torch.autograd.grad(logp.sum() + 0.5 * lse.sum(), (h, w))


CHECKS: dict[str, Check] = {
    "linear_logprobs": _check_logp,
    "attention_varlen": _check_attention,
    "linear": _check_linear,
    "rms_norm": _check_rms_norm,
    "swiglu": _check_swiglu,
    "rope": _check_rope,
}


def run(device: str, seed: int = 0) -> dict[str, Any]:
    import rlk_core.ops

    results = []
    for op, check in CHECKS.items():
        backend = REGISTRY.candidates(op, device)
        backend_id = backend[0].id if backend else "none"
        gen = torch.Generator().manual_seed(seed)
        t0 = time.perf_counter()
        try:
            checks = {k: {"passed": bool(ok), "detail": detail} for k, (ok, detail) in check(device, gen).items()}
        except Exception as exc:  # reported as a failed check, with the reason, never hidden
            checks = {"ran": {"passed": False, "detail": f"{type(exc).__name__}: {exc}"}}
        results.append({"op": op, "backend_id": backend_id, "contract_id": OP_CONTRACTS[op], "checks": checks,
                        "seconds": round(time.perf_counter() - t0, 3)})
    missing = sorted(set(OP_CONTRACTS) - set(CHECKS))
    return {
        "schema": SCHEMA,
        "rlk_core": rlk_core.__version__,
        "torch": torch.__version__,
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "passed": all(c["passed"] for r in results for c in r["checks"].values()),
        "ops": results,
        "ops_without_checks": missing,
    }


def format_table(report: dict[str, Any]) -> str:
    rows = [("op", "backend", "contract", "check", "result")]
    for r in report["ops"]:
        for name, c in r["checks"].items():
            rows.append((r["op"], r["backend_id"], r["contract_id"], name, "pass" if c["passed"] else "FAIL"))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for r in report["ops"]:
        for name, c in r["checks"].items():
            if not c["passed"]:
                lines.append(f"\n{r['op']} {name}: {c['detail']}")
    verdict = "PASSED" if report["passed"] else "FAILED"
    lines.append(f"\nrlk-selfcheck on {report['device']} ({report['device_name']}): {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlk-selfcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--json", type=Path, default=None, help="write the report as JSON to this path")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        parser.error(f"--device {device!r}: allowed cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    report = run(device, args.seed)
    print(format_table(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"report written to {args.json}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
