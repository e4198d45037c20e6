"""``rlk-repro report``: the summary agrees with the runs' own bitwise documents; plots are written for
several runs and for a matrix root's cells; a single run reports into its own report/ folder; bad inputs
are one-line errors; runs are named by their routes and drawn each in their own style; plots say where
curves coincide, where there are no differences and (only there) where round 0 compiled kernels."""

from __future__ import annotations

import json
import shutil

import pytest

from rlk_core.plan import RoutePlan
from rlk_repro import cli, report
from rlk_repro.engine.local import run_local
from rlk_repro.report import load_run, route_label, summarize, write_report


def test_summary_and_plots_for_two_runs(rr_run, pp_run, tmp_path, capsys):
    out = tmp_path / "report"
    assert cli.main(["report", str(rr_run.run_dir), str(pp_run.run_dir), "--output", str(out)]) == cli.EXIT_OK
    doc = json.loads((out / "metrics-summary.json").read_text())
    assert doc["schema"] == "rlk.repro-report.v1"
    by_mode = {r["mode"]: r for r in doc["runs"]}
    for mode, run in (("consistency", rr_run), ("native", pp_run)):
        summary = by_mode[mode]
        assert summary["compared_tokens"] == run.bitwise["element_count"]
        assert summary["mismatch_count"] == run.bitwise["mismatch_count"]
        assert summary["max_abs_diff"] == pytest.approx(run.bitwise["max_abs_diff"])
    assert by_mode["consistency"]["mismatch_count"] == 0 and by_mode["native"]["mismatch_count"] > 0
    for name in ("consistency.png", "learning.png", "optimization.png", "performance.png"):
        png = (out / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name
    table = (out / "metrics-summary.md").read_text()
    assert table.count("\n| ") == 3  # header + two runs
    assert "wrote" in capsys.readouterr().out


def test_token_weighted_mean_and_truncation(pp_run):
    s = summarize(load_run(pp_run.run_dir))
    rows = pp_run.rounds
    weighted = sum(r["mean_abs_diff"] * r["compared_tokens"] for r in rows) / sum(r["compared_tokens"] for r in rows)
    assert s["mean_abs_diff"] == pytest.approx(weighted)
    assert 0.0 <= s["truncation"] <= 1.0 and s["rounds"] == len(rows)


def test_single_run_reports_into_its_report_folder(rr_run, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(rr_run.run_dir, run)
    assert cli.main(["report", str(run)]) == cli.EXIT_OK
    assert (run / "report" / "metrics-summary.md").is_file()
    assert (run / "report" / "summary.md").read_text() == (rr_run.run_dir / "report" / "summary.md").read_text()


@pytest.mark.parametrize("case", ["missing", "not_a_run", "two_runs_no_output", "bad_schema"])
def test_bad_inputs_are_one_line_errors(case, rr_run, tmp_path, capsys):
    if case == "missing":
        args = [str(tmp_path / "nope")]
    elif case == "not_a_run":
        args = [str(tmp_path)]
    elif case == "two_runs_no_output":
        args = [str(rr_run.run_dir), str(rr_run.run_dir)]
    else:
        run = tmp_path / "run"
        shutil.copytree(rr_run.run_dir, run)
        (run / "metrics.jsonl").write_text('{"schema": "other"}\n')
        args = [str(run)]
    assert cli.main(["report", *args]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.strip() and "Traceback" not in err and len(err.strip().splitlines()) == 1


# -- matrix roots ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def matrix_root(rr_run, pp_run, small_config, tmp_path_factory):
    """A matrix root of three cells (two copied from the session runs, one run here) plus the things a
    real root also holds: its matrix report, an interrupted cell's leftovers."""
    root = tmp_path_factory.mktemp("matrix")
    shutil.copytree(rr_run.run_dir, root / "control-RR")
    shutil.copytree(pp_run.run_dir, root / "native-PP")
    run_local(small_config(RoutePlan("R/R", "P/R", "R/R"), rounds=2), root, run_name="ffn-PR")
    (root / "matrix-report.json").write_text("{}")
    (root / "ffn-RP.interrupted-x").mkdir()
    return root


def test_a_matrix_root_is_reported_as_its_cells(matrix_root, tmp_path, capsys):
    root = tmp_path / "m"
    shutil.copytree(matrix_root, root)
    assert cli.main(["report", str(root)]) == cli.EXIT_OK  # default output: the root's report/ folder
    out = root / "report"
    doc = json.loads((out / "metrics-summary.json").read_text())
    assert [(r["cell"], r["label"]) for r in doc["runs"]] == [
        ("control-RR", "consistency R/R"), ("ffn-PR", "ffn P/R"), ("native-PP", "native P/P")]
    assert doc["matrix_roots"] == [str(root)] and doc["skipped"] == []
    for name in ("consistency.png", "learning.png", "optimization.png", "performance.png", "matrix.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    table = (out / "metrics-summary.md").read_text()
    assert "| ffn P/R | ffn-PR |" in table and "{" not in table
    printed = capsys.readouterr().out
    assert "run: ffn P/R" in printed and "{" not in printed


def test_an_unreadable_cell_is_named_and_the_others_reported(matrix_root, tmp_path, capsys):
    root = tmp_path / "m"
    shutil.copytree(matrix_root, root)
    (root / "logp-RP").mkdir()  # a cell that failed before writing anything
    assert cli.main(["report", str(root), "--output", str(tmp_path / "out")]) == cli.EXIT_OK
    err = capsys.readouterr().err
    assert "rlk-repro report: matrix cell not reported:" in err and "logp-RP" in err
    doc = json.loads((tmp_path / "out" / "metrics-summary.json").read_text())
    assert len(doc["runs"]) == 3 and len(doc["skipped"]) == 1 and "logp-RP" in doc["skipped"][0]
    assert "logp-RP" in (tmp_path / "out" / "metrics-summary.md").read_text().split("Not reported")[1]
    # a root none of whose cells can be read is a one-line error
    empty = tmp_path / "broken"
    (empty / "control-RR").mkdir(parents=True)
    assert cli.main(["report", str(empty), "--output", str(tmp_path / "out2")]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert "matrix root" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(("plan", "label"), [
    ({"attention": "R/R", "ffn": "R/R", "logp": "R/R"}, "consistency R/R"),
    ({"attention": "P/P", "ffn": "P/P", "logp": "P/P"}, "native P/P"),
    ({"attention": "R/R", "ffn": "P/R", "logp": "R/R"}, "ffn P/R"),
    ({"attention": "R/P", "ffn": "R/R", "logp": "R/R"}, "attention R/P"),
    ({"logp": "P/R", "attention": "R/P", "ffn": "R/R"}, "attention R/P, logp P/R"),
    ({"attention": "P/R", "ffn": "P/R", "logp": "P/R"}, "all P/R"),
])
def test_runs_are_named_by_their_routes(plan, label):
    assert route_label(plan) == label


# -- what the plots say ------------------------------------------------------------------------------
def _fake_run(path, plan, device="cpu", exit_code=0, **series):
    """A run directory with a hand-written manifest and 4 rounds of metrics; ``series`` overrides a metric
    per round (e.g. ``loss=[...]``)."""
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({
        "schema": "rlk.manifest.v1", "run_id": path.name, "mode": "consistency", "plan": plan,
        "hardware": {"device": device}, "config": {"device": device}}))
    rows = []
    for i in range(4):
        row = {"schema": "rlk.metrics.v1", "round": i, "compared_tokens": 100, "mismatch_count": 0,
               "max_abs_diff": 0.0, "mean_abs_diff": 0.0, "reward_mean": 0.1 * i, "reward_std": 0.05,
               "loss": -0.1 - i, "grad_norm": 3.0 - i / 10, "rollout_seconds": 1.0 + i, "train_seconds": 0.5,
               "rollout_tokens_per_s": 100.0, "train_tokens_per_s": 200.0, "rollout_tokens": 100,
               "train_tokens": 100, "samples": 8, "eos_finished": 4}
        row.update({k: v[i] for k, v in series.items()})
        rows.append(json.dumps(row))
    (path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    (path / "exit-code").write_text(f"{exit_code}\n")
    return path


RR = {"attention": "R/R", "ffn": "R/R", "logp": "R/R"}
PP = {"attention": "P/P", "ffn": "P/P", "logp": "P/P"}


@pytest.fixture(name="figures")
def _figures(monkeypatch):
    """Report the given runs; returns ``{png name: matplotlib figure}`` instead of reading PNGs back."""
    def make(paths, out):
        shown = {}
        monkeypatch.setattr(report, "save_png", lambda fig, path: shown.setdefault(path.name, fig))
        write_report([str(p) for p in paths], str(out))
        return shown
    return make


def _titles(fig):
    return {ax.get_title(loc="left").strip().splitlines()[0]: ax for ax in fig.axes if ax.get_title(loc="left")}


def _texts(ax):
    return " ".join([ax.get_title(loc="left"), *(t.get_text() for t in ax.texts)])


def test_every_run_has_its_own_colour_and_line_style_or_marker(figures, tmp_path):
    plans = [RR, PP] + [{**RR, m: c} for m in ("attention", "ffn", "logp") for c in ("P/R", "R/P", "P/P")]
    paths = [_fake_run(tmp_path / f"r{i}", plan, loss=[-float(i)] * 4) for i, plan in enumerate(plans)]
    paths.append(_fake_run(tmp_path / "again", RR))  # a second consistency run: same route, its own look
    fig = figures(paths, tmp_path / "out")["optimization.png"]
    lines = _titles(fig)["GRPO loss"].get_lines()
    assert len(lines) == 12
    assert len({line.get_color() for line in lines}) == 12
    assert len({(line.get_linestyle(), line.get_marker()) for line in lines}) == 12
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "consistency R/R (again)" in legend and "ffn P/R" in legend and not any("{" in t for t in legend)


def test_coinciding_curves_are_named(figures, tmp_path):
    a = _fake_run(tmp_path / "a", RR, loss=[-1.0, -2.0, -3.0, -4.0])
    b = _fake_run(tmp_path / "b", PP, mismatch_count=[5, 6, 7, 8], max_abs_diff=[1e-7] * 4,
                  mean_abs_diff=[1e-8] * 4, loss=[-1.0, -2.0, -3.0, -4.5])
    shown = figures([a, b], tmp_path / "out")
    learning, optimization = _titles(shown["learning.png"]), _titles(shown["optimization.png"])
    assert "coincide exactly (consistency R/R = native P/P)" in _texts(learning["reward (mean, band: ± std)"])
    assert "coincide" not in _texts(optimization["GRPO loss"])  # differs in the last round
    assert "coincide" in _texts(optimization["gradient norm"])
    consistency = _titles(shown["consistency.png"])
    assert "coincide" not in _texts(consistency["mismatched tokens"])
    # the all-zero run cannot be drawn on the log axis: the panel says so rather than lose it silently
    assert "not drawn on the log axis): consistency R/R" in _texts(consistency["max abs(train - rollout)"])


def test_a_drift_plot_without_differences_says_so(figures, tmp_path):
    a, b = _fake_run(tmp_path / "a", RR), _fake_run(tmp_path / "b", RR, reward_mean=[0.5] * 4)
    panels = _titles(figures([a, b], tmp_path / "out")["consistency.png"])
    assert len(panels) == 4
    for ax in panels.values():
        assert "no differences" in _texts(ax)
        assert ax.get_ylim()[0] > -0.05 and list(ax.get_yticks()) == [0]
    c = _fake_run(tmp_path / "c", PP, mismatch_count=[5, 6, 7, 8], max_abs_diff=[1e-7] * 4,
                  mean_abs_diff=[1e-8] * 4)
    panels = _titles(figures([a, c], tmp_path / "out2")["consistency.png"])
    assert not any("no differences" in _texts(ax) for ax in panels.values())
    assert all(ax.get_ylim()[0] >= 0 for ax in panels.values())


@pytest.mark.parametrize(("device", "plan", "compiled"), [
    ("cpu", RR, False), ("cuda", RR, True), ("cuda:1", {**RR, "ffn": "P/R"}, True), ("cuda", PP, False)])
def test_round_0_compiles_kernels_only_where_it_did(device, plan, compiled, figures, tmp_path):
    run = _fake_run(tmp_path / "run", plan, device=device)
    shown = figures([run], tmp_path / "out")
    table = (tmp_path / "out" / "metrics-summary.md").read_text()
    assert ("compiles the Triton kernels" in table) is compiled and "warm-up" in table
    assert ("compiles" in shown["performance.png"].get_suptitle()) is compiled
    summary = json.loads((tmp_path / "out" / "metrics-summary.json").read_text())["runs"][0]
    assert summary["kernels_compiled"] is compiled


def test_pngs_are_small(rr_run, pp_run, tmp_path):
    write_report([str(rr_run.run_dir), str(pp_run.run_dir)], str(tmp_path))
    sizes = {p.name: p.stat().st_size for p in tmp_path.glob("*.png")}
    assert len(sizes) == 4 and all(5_000 < s < 100_000 for s in sizes.values()), sizes


# -- provenance, units, notes, warnings and status (issue 41) ----------------------------------------------
def _footer(fig) -> str:
    return fig._supxlabel.get_text() if fig._supxlabel is not None else ""


def test_every_figure_names_model_device_dtype_commit_and_run_ids(rr_run, pp_run, figures, tmp_path):
    shown = figures([rr_run.run_dir, pp_run.run_dir], tmp_path / "out")
    assert set(shown) == {"consistency.png", "learning.png", "optimization.png", "performance.png"}
    sha = json.loads((rr_run.run_dir / "manifest.json").read_text())["repos"][0]["sha"][:10]
    for name, fig in shown.items():
        text = _footer(fig)
        assert "model tiny" in text and "device cpu" in text and "dtype float32" in text, (name, text)
        assert f"commit {sha}" in text and rr_run.run_id in text and pp_run.run_id in text, (name, text)


def test_log_prob_differences_are_in_nats_and_times_in_seconds(rr_run, pp_run, figures, tmp_path):
    shown = figures([rr_run.run_dir, pp_run.run_dir], tmp_path / "out")
    consistency, performance = _titles(shown["consistency.png"]), _titles(shown["performance.png"])
    assert "nats" in consistency["max abs(train - rollout)"].get_ylabel()
    assert "nats" in consistency["mean abs(train - rollout)"].get_ylabel()
    assert performance["rollout seconds per round"].get_ylabel() == "seconds"
    assert performance["training tokens / s"].get_ylabel() == "tokens / s"
    assert "in nats" in (tmp_path / "out" / "metrics-summary.md").read_text()


def test_the_cpu_reference_is_noted_where_r_ran_it(rr_run, pp_run, figures, tmp_path):
    shown = figures([rr_run.run_dir, pp_run.run_dir], tmp_path / "out")
    assert "R ran rlk.reference on the rollout and train side" in _footer(shown["consistency.png"])
    runs = {r["route"] if "route" in r else r["label"]: r for r in
            json.loads((tmp_path / "out" / "metrics-summary.json").read_text())["runs"]}
    assert "rlk.reference" in runs["consistency R/R"]["reference_note"]
    assert runs["native P/P"]["reference_note"] is None  # P/P ran no rlk op


def test_runs_that_differ_in_more_than_routes_are_warned_about(small_config, tmp_path, figures, capsys):
    a = run_local(small_config(RoutePlan.preset("consistency"), rounds=2), tmp_path / "a")
    b = run_local(small_config(RoutePlan.preset("native"), rounds=2, lr=1e-2), tmp_path / "b")
    c = run_local(small_config(RoutePlan.preset("native"), rounds=2), tmp_path / "c")
    assert cli.main(["report", str(a.run_dir), str(b.run_dir), "--output", str(tmp_path / "ab")]) == 0
    err = capsys.readouterr().err
    assert "warning: the compared runs differ in more than their routes: config.lr: 0.003" in err
    assert "config.lr" in (tmp_path / "ab" / "metrics-summary.md").read_text()
    assert "WARNING" in _footer(figures([a.run_dir, b.run_dir], tmp_path / "ab2")["learning.png"])
    assert cli.main(["report", str(a.run_dir), str(c.run_dir), "--output", str(tmp_path / "ac")]) == 0
    assert "warning" not in capsys.readouterr().err  # the same experiment on two routes: no warning


@pytest.mark.parametrize(("exit_code", "mark"), [(130, "interrupted (130)"), (3, "failed (3)"),
                                                 (1, "FAILED bitwise (1)"), (None, "unfinished (no exit-code)")])
def test_interrupted_and_failed_runs_are_marked(exit_code, mark, figures, tmp_path):
    good = _fake_run(tmp_path / "good", RR)
    bad = _fake_run(tmp_path / "bad", PP)
    if exit_code is None:
        (bad / "exit-code").unlink()
    else:
        (bad / "exit-code").write_text(f"{exit_code}\n")
    shown = figures([good, bad], tmp_path / "out")
    legend = [t.get_text() for t in shown["learning.png"].legends[0].get_texts()]
    assert legend == ["consistency R/R", f"native P/P [{mark}]"]
    table = (tmp_path / "out" / "metrics-summary.md").read_text()
    assert "| exit status | validated |" in table and f"| {mark} |" in table and "| ok |" in table


def test_the_summary_has_a_validated_column(rr_run, tmp_path, capsys):
    from rlk_validate.cli import main as validate_main

    run = tmp_path / "run"
    shutil.copytree(rr_run.run_dir, run)
    assert cli.main(["report", str(run), "--output", str(tmp_path / "r1")]) == 0
    assert "validated: not validated" in capsys.readouterr().out
    assert validate_main([str(run), "--seal", "--require-bitwise", "-q"]) == 0
    assert cli.main(["report", str(run), "--output", str(tmp_path / "r2")]) == 0
    assert "validated: sealed (passed)" in capsys.readouterr().out
    doc = json.loads((tmp_path / "r2" / "metrics-summary.json").read_text())["runs"][0]
    assert (doc["exit"], doc["exit_code"], doc["validated"]) == ("ok", 0, "sealed (passed)")


# -- how much the evidence says, per round (issue 41, item 13) ------------------------------------------------------
def test_the_report_shows_entropy_and_informative_tokens_per_round(figures, tmp_path, capsys):
    live = _fake_run(tmp_path / "live", RR, entropy_mean=[1.9, 1.8, 1.85, 1.7], max_entropy=[5.77] * 4,
                     informative_fraction=[0.98, 0.97, 0.99, 0.96])
    collapsed = _fake_run(tmp_path / "collapsed", PP, sampled_nll_mean=[1.9, 0.7, 0.1, 0.01], max_entropy=[5.77] * 4,
                          informative_fraction=[0.9, 0.5, 0.08, 0.02])  # only estimated, as the frameworks engine
    shown = figures([live, collapsed], tmp_path / "out")
    panels = _titles(shown["learning.png"])
    entropy = panels["entropy of the sampling distribution (mean per sampled token)"]
    assert [list(line.get_ydata()) for line in entropy.get_lines()[:2]] == [[1.9, 1.8, 1.85, 1.7],
                                                                             [1.9, 0.7, 0.1, 0.01]]
    assert entropy.get_ylabel() == "nats" and entropy.get_ylim()[1] > 5.77  # the ceiling log V is drawn
    assert "log V = 5.77 nats" in _texts(entropy) and "estimated from the sampled tokens' log-probs: native P/P" \
        in _texts(entropy)
    informative = panels["informative tokens (rollout log-prob < -0.001)"]
    assert list(informative.get_lines()[1].get_ydata()) == [0.9, 0.5, 0.08, 0.02]
    assert "bound 0.1" in _texts(informative)
    table = (tmp_path / "out" / "metrics-summary.md").read_text()
    assert "- consistency R/R: entropy [1.9, 1.8, 1.85, 1.7] of 5.77; informative [98%, 97%, 99%, 96%]" in table
    assert "- native P/P: entropy ~[1.9, 0.7, 0.1, 0.01]" in table and "| ~1.9 -> ~0.01 | 2% |" in table
    assert "native P/P: informative tokens (rollout log-prob < -0.001) below rlk-validate's bound 0.1 in round(s) " \
        "2, 3" in table
    doc = json.loads((tmp_path / "out" / "metrics-summary.json").read_text())
    assert doc["runs"][0]["entropy_per_round"] == [1.9, 1.8, 1.85, 1.7] and doc["runs"][1]["entropy_estimated"]
    assert doc["runs"][1]["informative_low_rounds"] == [2, 3] and not doc["runs"][0]["informative_low_rounds"]
    assert cli.main(["report", str(live), str(collapsed), "--output", str(tmp_path / "cli")]) == cli.EXIT_OK
    assert "warning: native P/P: informative tokens" in capsys.readouterr().err


def test_runs_from_before_the_evidence_metrics_say_so(figures, tmp_path):
    old = _fake_run(tmp_path / "old", RR)
    panels = _titles(figures([old], tmp_path / "out")["learning.png"])
    assert "not recorded by these runs" in _texts(panels["entropy of the sampling distribution (mean per sampled "
                                                         "token)"])
    table = (tmp_path / "out" / "metrics-summary.md").read_text()
    assert "| not recorded | not recorded |" in table and "entropy [-, -, -, -]" in table
