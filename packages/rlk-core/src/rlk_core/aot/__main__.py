"""``python -m rlk_core.aot build --target cuda:90 --out DIR`` (options ``--families``, ``--dtypes``, ``--sms``,
``--jobs``, ``--triton-cache``; ``--target hip:gfx942``: the row-wise families' AMD code objects, not launched yet)
and ``python -m rlk_core.aot list`` (the variants, one a line). Progress per variant on stderr; exits 1 if any
variant failed to compile (the manifest records which and why)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from rlk_core.aot import build as B

    p = argparse.ArgumentParser(prog="python -m rlk_core.aot", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("build", "list"):
        s = sub.add_parser(name)
        s.add_argument("--families", default=None, help=f"comma-separated, of {sorted(B.FAMILIES)} (default: all; on "
                       f"a hip target {B.HIP_FAMILIES})")
        s.add_argument("--dtypes", default=",".join(B.DTYPES), help=f"comma-separated, of {sorted(B.DTYPES)}")
        s.add_argument("--target", default="cuda:90", choices=sorted(B.TARGETS))
        s.add_argument("--sms", type=int, default=None, help="SM count: the persistent kernels' NUM_PROGRAMS "
                       f"(default: the target's, {B.TARGET_SMS})")
        if name == "build":
            s.add_argument("--out", required=True)
            s.add_argument("--jobs", type=int, default=None)
            s.add_argument("--triton-cache", default=None, help="compile through this Triton cache folder (shared): "
                           "a JIT pointed at it (TRITON_CACHE_DIR) loads these compiles for the same launches")
    a = p.parse_args(argv)
    families = [f for f in (a.families or "").split(",") if f] or None
    dtypes = [d for d in a.dtypes.split(",") if d]
    unknown = sorted(set(families or ()) - set(B.FAMILIES)) + sorted(set(dtypes) - set(B.DTYPES))
    if unknown:
        p.error(f"unknown families / dtypes {unknown}")
    if a.cmd == "list":
        hip = a.target.startswith("hip:")
        for v in B.enumerate_variants(families or (B.HIP_FAMILIES if hip else B.FAMILIES), dtypes, a.target, a.sms):
            print(f"{v['family']} {v['kernel']}{v['spec']}")
        return 0
    m = B.build(a.target, a.out, families, dtypes, sms=a.sms, jobs=a.jobs, progress=B.print_progress,
                triton_cache=a.triton_cache)
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
