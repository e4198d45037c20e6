"""``python -m rlk_core.aot build --target cuda:90 --out DIR`` (or ``--target hip:gfx942``: the row-wise
families' AMD code objects, not launched yet; options: ``--ops``, ``--dtypes``, ``--layouts``,
``--sms``, ``--jobs``, ``--triton-cache``) and ``python -m rlk_core.aot list`` (the variants, one a line). Progress
per variant on stderr; exits 1 if any variant failed to compile (the manifest records which and why)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from rlk_core.aot.specs import DEFAULT_SMS, LAYOUTS, OPS

    p = argparse.ArgumentParser(prog="python -m rlk_core.aot", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("build", "list"):
        s = sub.add_parser(name)
        s.add_argument("--ops", default=None, help=f"comma-separated, of {OPS} (default: all; on a hip target the "
                       "families it can take, rlk_core.aot.build.HIP_OPS)")
        s.add_argument("--sms", type=int, default=None, help="SM count: the persistent GEMM's NUM_PROGRAMS (default: "
                       f"the target's, rlk_core.aot.build.TARGET_SMS; else {DEFAULT_SMS})")
        s.add_argument("--dtypes", default="bf16,fp16,fp32", help="comma-separated, of bf16, fp16, fp32")
        s.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {LAYOUTS}")
        if name == "build":
            s.add_argument("--target", default="cuda:90")
            s.add_argument("--out", required=True)
            s.add_argument("--jobs", type=int, default=None)
            s.add_argument("--triton-cache", default=None,
                           help="compile through this Triton cache folder (shared) instead of a private one each: "
                                "a JIT pointed at it (TRITON_CACHE_DIR) loads these compiles for the same launches")
    a = p.parse_args(argv)
    from rlk_core.aot.build import HIP_OPS
    from rlk_core.aot.specs import TRITON_TYPE, enumerate_specs

    if a.ops is None:
        a.ops = ",".join(HIP_OPS if getattr(a, "target", "").startswith("hip:") else OPS)
    if a.sms is None:
        from rlk_core.aot.build import TARGET_SMS

        a.sms = TARGET_SMS.get(getattr(a, "target", "cuda:90"), DEFAULT_SMS)

    by_name = {v: k for k, v in TRITON_TYPE.items()}
    dtypes = [by_name[d] for d in a.dtypes.split(",") if d]
    specs = enumerate_specs([o for o in a.ops.split(",") if o], dtypes, sms=a.sms, layouts=a.layouts.split(","))
    if a.cmd == "list":
        for s in specs:
            print(s.name)
        return 0
    from rlk_core.aot.build import build, print_progress

    selection = {"ops": [o for o in a.ops.split(",") if o], "dtypes": [d for d in a.dtypes.split(",") if d],
                 "layouts": a.layouts.split(",")}
    m = build(a.target, a.out, specs, sms=a.sms, jobs=a.jobs, progress=print_progress, triton_cache=a.triton_cache,
              selection=selection)
    kind = "code objects" if a.target.startswith("hip:") else "cubins"
    print(f"{len(m['kernels'])} {kind}, {len(m['failed'])} failed -> {a.out}", file=sys.stderr)
    tc = m.get("triton_cache")
    if tc is not None:
        odd = tc["other_key"] + tc["incomplete"]
        print(f"Triton cache {a.triton_cache}: {tc['variants']} variants, {len(tc['other_key'])} compiled under "
              f"another key, {len(tc['incomplete'])} not complete under theirs: {odd[:4]}", file=sys.stderr)
    return 1 if m["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
