"""``rlk-validate``: command line. Exit codes: 0 passed, 1 failed, 2 incomplete, 3 unusable input or
usage, 4 internal error (a bug in rlk-validate). Never prints a traceback unless ``--debug``."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from . import __version__
from .evidence import MIN_INFORMATIVE_FRACTION, write_json_atomic
from .findings import CODES
from .report import EXIT_CODES, EXIT_INTERNAL, clean, finite
from .safeio import Caps, MiB

EXIT_USAGE = EXIT_CODES["unusable"]
_NUMBER = re.compile(r"-[0-9.]+(?:e-?[0-9]+)?")


class UsageError(Exception):
    pass


SUBCOMMANDS = """subcommands:
  rlk-validate [run] RUN_DIR [options]      check one run directory (`run` for a directory named like a subcommand)
  rlk-validate matrix MATRIX_ROOT [options] check every cell of an ablation matrix root
  rlk-validate ladder LADDER_ROOT [options] check every rung of a mismatch-knob ladder root (docs/ladder.md)
  rlk-validate codes                        list the finding codes
  rlk-validate keygen DIR                   write an Ed25519 key pair for signed seals (--sign-key, --verify-key)
  rlk-validate import-vime SRC DST          turn a VIME run's artifact directory into an rlk run directory
  rlk-validate vime-dumps DIR               compare the log-probs of VIME's --save-debug-train-data dumps"""


class _Parser(argparse.ArgumentParser):
    def __init__(self, **kw: Any) -> None:
        super().__init__(allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
                         epilog=SUBCOMMANDS, **kw)

    def error(self, message: str) -> None:  # argparse would exit 2, which means "incomplete" here
        raise UsageError(message)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:
        """Unknown options are named before anything else is complained about (``--bogus``)."""
        known = self._option_string_actions
        for tok in args or ():
            if tok == "--":
                break
            if tok.startswith("-") and tok != "-" and not _NUMBER.fullmatch(tok) and tok.split("=", 1)[0] not in known:
                raise UsageError(f"unknown option {clean(tok, 80)}")
        return super().parse_args(args, namespace)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json",
        metavar="OUT",
        help="write the schema-versioned JSON report to OUT (outside the checked directory)",
    )
    p.add_argument(
        "--require-bitwise",
        action="store_true",
        help="require bitwise-equal log-probs even when the plan is not all R/R",
    )
    p.add_argument(
        "--clip-eps", type=float, default=0.2, metavar="E", help="clip epsilon of the drift statistics (0.2)"
    )
    p.add_argument("--worst", type=int, default=10, metavar="K", help="how many worst tokens to list (10)")
    p.add_argument(
        "--allow-backend",
        action="append",
        default=[],
        metavar="ID",
        help="accept ID as an rlk backend of an R side (a plug-in's registered id); repeatable",
    )
    p.add_argument("--verify-key", metavar="PUB",
                   help="require the seal to be signed by this PEM Ed25519 public key (needs rlk-validate[sign])")
    p.add_argument("--min-informative-fraction", type=float, default=MIN_INFORMATIVE_FRACTION, metavar="F",
                   help="flag a round where fewer of the compared tokens than F have a rollout log-prob below -1e-3 "
                   f"(default {MIN_INFORMATIVE_FRACTION})")
    p.add_argument("--max-json-mib", type=float, default=Caps.json_bytes / MiB, metavar="N")
    p.add_argument("--max-log-mib", type=float, default=Caps.log_bytes / MiB, metavar="N")
    p.add_argument("--max-tensor-mib", type=float, default=Caps.tensor_bytes / MiB, metavar="N")
    p.add_argument("--max-stream-mib", type=float, default=Caps.stream_bytes / MiB, metavar="N",
                   help="cap of a file that is only hashed, streamed in chunks (a resume state): bounds the pass's "
                   "time, not memory (default 1 TiB)")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the verdict line")
    p.add_argument("-v", "--verbose", action="store_true", help="also print info findings")
    p.add_argument("--debug", action="store_true", help="show a traceback on an internal error")


def _run_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="rlk-validate",
        description="Check an rlk run directory and say whether the claim holds.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument(
        "--seal",
        action="store_true",
        help="write run-validation.json into RUN_DIR and, only if it passed, COMPLETE",
    )
    p.add_argument("--sign-key", metavar="KEY",
                   help="with --seal: sign COMPLETE with this PEM Ed25519 private key (rlk-validate keygen DIR makes "
                   "one; needs rlk-validate[sign])")
    p.add_argument("--report", metavar="DIR", help="write consistency.png and drift.png into DIR (needs matplotlib)")
    p.add_argument("--version", action="version", version=f"rlk-validate {__version__}")
    _common(p)
    return p


def _matrix_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="rlk-validate matrix",
        description="Check every cell of an ablation matrix root. Writes nothing unless --write is given.",
    )
    p.add_argument("matrix_root", metavar="MATRIX_ROOT")
    p.add_argument("--allow-partial", action="store_true", help="absent cells are warnings, not incomplete")
    p.add_argument(
        "--write",
        action="store_true",
        help="write matrix-report.json and matrix-report.md into MATRIX_ROOT (only if it is a matrix root)",
    )
    p.add_argument("--no-write", action="store_true", help="write nothing (the default; kept for old scripts)")
    _common(p)
    return p


def _options(a: argparse.Namespace) -> Any:
    from .validate import Options

    if not (0 < a.clip_eps < 10):
        raise UsageError("--clip-eps must be in (0, 10)")
    if a.worst < 0:
        raise UsageError("--worst must be >= 0")
    for name in ("max_json_mib", "max_log_mib", "max_tensor_mib", "max_stream_mib"):
        if not getattr(a, name) > 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0")
    if not 0 <= a.min_informative_fraction <= 1:
        raise UsageError("--min-informative-fraction must be in [0, 1]")
    if a.verify_key is not None:
        from .signing import KeyProblem, load_public_key

        try:
            load_public_key(a.verify_key)  # a key that cannot be used stops before any check
        except KeyProblem as e:
            raise UsageError(f"--verify-key: {e}") from None
    caps = Caps(
        json_bytes=int(a.max_json_mib * MiB),
        log_bytes=int(a.max_log_mib * MiB),
        tensor_bytes=int(a.max_tensor_mib * MiB),
        stream_bytes=int(a.max_stream_mib * MiB),
    )
    return Options(
        require_bitwise=a.require_bitwise,
        clip_eps=a.clip_eps,
        worst_k=a.worst,
        allowed_backends=frozenset(a.allow_backend),
        caps=caps,
        verify_key=a.verify_key,
        min_informative_fraction=a.min_informative_fraction,
    )


def _inside(path: str, directory: str) -> bool:
    p = os.path.realpath(os.path.abspath(path))
    d = os.path.realpath(os.path.abspath(directory))
    return p == d or p.startswith(d.rstrip(os.sep) + os.sep)


def _write_json(out: str, doc: dict[str, Any]) -> None:
    write_json_atomic(os.path.abspath(out), finite(doc))


def _check_outputs(a: argparse.Namespace, checked: str, what: str) -> None:
    for flag in ("json", "report"):
        val = getattr(a, flag, None)
        if val and os.path.isdir(checked) and _inside(val, checked):
            raise UsageError(
                f"--{flag} {val} is inside {what}; rlk-validate does not write there "
                "(only --seal writes run-validation.json and COMPLETE)"
            )


def _print(text: str) -> None:
    """stdout that the reader may have left (``rlk-validate RUN | head``): the rest is dropped, the exit status
    is still the verdict's."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _main_run(argv: Sequence[str]) -> int:
    from .sealing import seal_run
    from .validate import validate_run

    a = _run_parser().parse_args(argv)
    _check_outputs(a, a.run_dir, "RUN_DIR")
    if a.sign_key and not a.seal:
        raise UsageError("--sign-key signs a seal: it needs --seal")
    opts = _options(a)
    if a.seal:
        from .signing import KeyProblem

        try:
            report = seal_run(a.run_dir, opts, sign_key=a.sign_key)
        except KeyProblem as e:
            raise UsageError(f"--sign-key: {e}") from None
    else:
        report = validate_run(a.run_dir, opts)
    _print(report.summary(verbose=a.verbose).splitlines()[-1] if a.quiet else report.summary(verbose=a.verbose))
    code = report.exit_code
    if a.report and not report.bitwise:
        print("rlk-validate: no train-data was compared; plots skipped", file=sys.stderr)
    elif a.report:
        from .plots import matplotlib_available, write_plots

        if matplotlib_available():
            try:
                for p in write_plots(report, a.report):
                    _print(f"wrote {clean(p)}")
            except OSError as e:
                print(
                    f"rlk-validate: cannot write plots into {clean(a.report)}: {e.strerror or e}",
                    file=sys.stderr,
                )
                code = max(code, EXIT_USAGE)
        else:
            print(
                "rlk-validate: matplotlib is not installed; plots skipped (pip install 'rlk-validate[plot]')",
                file=sys.stderr,
            )
    if a.json:
        try:
            _write_json(a.json, report.to_json())
        except OSError as e:
            print(f"rlk-validate: cannot write {clean(a.json)}: {e.strerror or e}", file=sys.stderr)
            return EXIT_USAGE
    return code


def _main_matrix(argv: Sequence[str]) -> int:
    from .matrix import validate_matrix

    a = _matrix_parser().parse_args(argv)
    _check_outputs(a, a.matrix_root, "MATRIX_ROOT")
    if a.write and a.no_write:
        raise UsageError("--write and --no-write contradict each other")
    rep = validate_matrix(a.matrix_root, _options(a), allow_partial=a.allow_partial, write=a.write)
    return _emit(a, rep)


def _emit(a: argparse.Namespace, rep: Any) -> int:
    """A root's report (matrix, ladder): its summary (the verdict line alone with ``-q``), ``--json``; its exit code."""
    _print(rep.summary().splitlines()[-1] if a.quiet else rep.summary())
    if a.json:
        try:
            _write_json(a.json, rep.to_json())
        except OSError as e:
            print(f"rlk-validate: cannot write {clean(a.json)}: {e.strerror or e}", file=sys.stderr)
            return EXIT_USAGE
    return rep.exit_code


def _main_ladder(argv: Sequence[str]) -> int:
    from .ladder import validate_ladder

    p = _Parser(prog="rlk-validate ladder", description="Check every rung of a ladder root (`rlk-repro ladder`): each "
                "rung as a run, its knobs, the skip records, the shared provenance, and ladder-report.json against the "
                "rungs' data. Writes nothing unless --write is given.")
    p.add_argument("ladder_root", metavar="LADDER_ROOT")
    p.add_argument("--write", action="store_true", help="write ladder-report.json and .md into LADDER_ROOT")
    _common(p)
    a = p.parse_args(argv)
    _check_outputs(a, a.ladder_root, "LADDER_ROOT")
    return _emit(a, validate_ladder(a.ladder_root, _options(a), write=a.write))


def _main_codes() -> int:
    _print("\n".join(f"{code:<26} {sev:<10} {meaning}" for code, (sev, meaning) in CODES.items()))
    return 0


def _main_keygen(argv: Sequence[str]) -> int:
    from .signing import KeyProblem, generate

    p = _Parser(prog="rlk-validate keygen", description="Write a new Ed25519 key pair for signed seals into DIR: "
                "rlk-seal.key (private, mode 0600: keep it secret) and rlk-seal.pub (give it to whoever checks your "
                "runs: rlk-validate RUN --verify-key rlk-seal.pub). Never overwrites a key.")
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    a = p.parse_args(argv)
    try:
        priv, pub = generate(a.directory)
    except KeyProblem as e:
        print(f"rlk-validate keygen: {clean(e)}", file=sys.stderr)
        return EXIT_USAGE
    _print(f"wrote {clean(priv)} (private: sign with --seal --sign-key) and {clean(pub)} (public: --verify-key)")
    return 0


def _main_import_vime(argv: Sequence[str]) -> int:
    from .vime import ImportProblem, import_vime

    p = _Parser(prog="rlk-validate import-vime", description="Write DST, an rlk run directory, from SRC, the "
                "artifact directory of a VIME run launched as `rlk-repro plan --engine vime` prints (docs/vime.md); "
                "SRC is only read, DST must not exist. Then check DST with `rlk-validate DST`.")
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument("--from", dest="source", choices=("records", "dumps"), default=None,
                   help="where train-data comes from when SRC holds both: the record hook's logprob-records/ or VIME's "
                   "--save-debug-train-data dumps in debug-train-data/ (default: the one SRC holds)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    a = p.parse_args(argv)
    try:
        s = import_vime(a.src, a.dst, a.source)
    except ImportProblem as e:
        print(f"rlk-validate import-vime: {clean(e)}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {s['dst']}: {s['rounds']} round(s), {s['record_files']} file(s) of {s['source']}/ from writer "
          f"rank(s) {s['writer_ranks']}, {s['vime_steps']} VIME step metric(s); now: rlk-validate {s['dst']}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    try:
        if args and args[0] == "matrix":
            return _main_matrix(args[1:])
        if args and args[0] == "ladder":
            return _main_ladder(args[1:])
        if args and args[0] == "codes":
            return _main_codes()
        if args and args[0] == "import-vime":
            return _main_import_vime(args[1:])
        if args and args[0] == "vime-dumps":  # issue 37: VIME's --save-debug-train-data dumps (rlk_validate.vime_dump)
            from .vime_dump import main as vime_dumps

            return vime_dumps(args[1:])
        if args and args[0] == "keygen":
            return _main_keygen(args[1:])
        if args and args[0] == "run":
            args = args[1:]
        return _main_run(args)
    except UsageError as e:
        print(f"rlk-validate: usage error: {e} (see rlk-validate --help)", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("rlk-validate: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout left before anything was printed
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_USAGE
    except Exception as e:
        if debug:
            raise
        print(
            f"rlk-validate: internal error, a bug in rlk-validate rather than in your run: "
            f"{type(e).__name__}: {clean(e)} (rerun with --debug for details)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
