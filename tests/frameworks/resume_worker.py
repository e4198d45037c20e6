"""``rlk-repro ARGS...`` in this process, for tests/frameworks/test_resume_exact.py: ``--interrupt-at K`` raises
KeyboardInterrupt (what Ctrl-C raises) as the frameworks loop enters round ``K``; ``--weights FILE`` writes, as the
run finishes, the sha256 of every trainer parameter (bf16, what vLLM was last given) and fp32 master as JSON. Exits
with the command's status (130 when interrupted)."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import torch


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--interrupt-at", type=int, default=None)
    ap.add_argument("--weights", default=None)
    ap.add_argument("rlk_repro", nargs=argparse.REMAINDER, help="the rlk-repro command line (run ...)")
    a = ap.parse_args(argv)
    rest = a.rlk_repro
    from rlk_repro import cli
    from rlk_repro.engine import frameworks

    real_round, real_finish = frameworks._Run._round, frameworks._Run._finish

    def round_(self, rnd):
        if rnd == a.interrupt_at:
            raise KeyboardInterrupt
        return real_round(self, rnd)

    def finish(self, rounds):
        if a.weights:
            doc = {"params": {n: _digest(p) for n, p in self.trainer.params.items()},
                   "master": {n: _digest(m) for n, m in self.trainer.master.items()}}
            with open(a.weights, "w") as fh:
                json.dump(doc, fh)
        return real_finish(self, rounds)

    frameworks._Run._round, frameworks._Run._finish = round_, finish
    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
