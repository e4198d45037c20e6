"""Driver for compute-sanitizer over rlk.cuda: every served call of one family's sweep (``tests/core/_cuda_cases.py``),
launched through rlk.cuda and synchronised one by one, each named before it runs — the last name printed is the
call that faulted.

    PYTHONPATH=tests/core compute-sanitizer --tool memcheck python tests/gpu/probe_cuda_cases.py kv_cache_write

FAMILY: ``attention``, ``kv_cache_write``, ``attention_backward`` or ``logp`` (bf16 cases only). Not a pytest module.
"""

from __future__ import annotations

import sys

import _cuda_cases as K
import torch

from rlk_core import ops  # noqa: F401  (registers the backends)
from rlk_core.backends import REGISTRY

SWEEPS = {"attention": K.attention_forward_cases, "kv_cache_write": K.kv_cache_write_cases,
          "attention_backward": K.attention_backward_cases, "logp": K.logprob_cases}


def main(family: str) -> int:
    n = 0
    for op, args, served in SWEEPS[family]("cuda", (torch.bfloat16,)):
        if not served:
            continue
        backend = REGISTRY.get(op, "rlk.cuda")
        print(f"{n}: {op} {K.describe(args)}", flush=True)
        backend.fn(*args)
        torch.cuda.synchronize()
        n += 1
    print(f"{n} calls, no fault", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
