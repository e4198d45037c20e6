"""``rlk-repro attribute RUN_DIR``: why train and rollout log-probs differ, localised to the first operator boundary
where the two sides' bits part — after the probes that must pass before any operator may be blamed.

On a fixed set of sampled sequences of one round (``--round``, ``--sequences``), the probes in the seeds' order:

0. replay fidelity — the replay reproduces the run's recorded rollout and train log-probs bit for bit (else the
   comparison would be of something other than the run);
1. sample and token identity — prompt, response tokens, loss mask, shifted targets, positions, response slice;
2. model state — the weights' hash against the one the run recorded, and both sides computing with the same bits;
3. pre-softmax logits at the selected positions — the rollout's materialised logits against the trainer's;
4. log-sum-exp and the selected logit, separately;
5. the vocab-parallel reduce per TP rank;
6. the kept token sets under top-p / top-k (the semantics the manifest records, and the sets themselves);
7. native and rlk log-prob implementations and every registered backend on the same fixed tokens (the operator A/B
   harness, :mod:`rlk_repro.abtest`, on the captured final hidden states).

Then the per-layer comparison (:mod:`rlk_repro.attribute_dumps`): the first point, in forward order, where the bits
part, and how the residual stream's difference grows through the stack. The verdict names that boundary only when
probes 0, 1, 2 and 6 pass: a semantic or framework failure comes first, and no operator is blamed while one stands.

Output (``--output``, default ``<RUN_DIR>.attribution-r<round>`` beside the run; never inside it: a run directory is
append-only and may be sealed): ``attribution.json`` (``rlk.attribution.v1``), ``attribution.md``, the two sides'
dumps (``dumps/train.safetensors``, ``dumps/rollout.safetensors``) and ``ab-tensors.safetensors`` for
``rlk-repro abtest --tensors``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from rlk_core.errors import RlkConfigError
from rlk_repro import abtest
from rlk_repro.attribute_dumps import compare_dumps, diff_stats, layer_of, operator_of, save_dump
from rlk_repro.attribute_local import Injection, LocalReplay, lm_head, read_manifest, replay_local
from rlk_repro.model.weights import weights_sha256
from rlk_validate import evidence

ATTRIBUTION_SCHEMA = "rlk.attribution.v1"
BLOCKING = (0, 1, 2, 6)  # a failure here stops operator blame
PASS, FAIL, DRIFT, TRIVIAL, NA = "pass", "fail", "drift", "trivial", "not_available"


def _probe(pid: int, name: str, status: str, detail: str, **evidence_: Any) -> dict[str, Any]:
    return {"id": pid, "name": name, "status": status, "detail": detail, "evidence": evidence_}


def _eq(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(abtest.bit_equal(a.float().contiguous(), b.float().contiguous()))


# -- the probes ----------------------------------------------------------------------------------------------------
def probe_fidelity(rp: LocalReplay, injection: Injection | None) -> dict[str, Any]:
    td, bad = rp.train_data, []
    for s in rp.selected:
        m = td["response_mask"][s]
        for side, got, rec in (("rollout", rp.rollout_logprobs[s], td["rollout_logprobs"][s][m]),
                               ("train", rp.train_logprobs[s], td["train_logprobs"][s][m])):
            if got.shape != rec.shape or not _eq(got, rec):
                bad.append({"sequence": s, "side": side})
    injected = {b["side"] for b in bad} <= ({injection.side} if injection else set())
    if not bad:
        return _probe(0, "replay fidelity", PASS, "the replay reproduces every recorded log-prob of the selected "
                      "sequences bit for bit, on both sides")
    if injected and injection is not None:
        return _probe(0, "replay fidelity", PASS, f"only the injected side ({injection.side}) departs from its "
                      "recorded log-probs, as the injection makes it", departures=bad, injected=True)
    return _probe(0, "replay fidelity", FAIL, f"{len(bad)} (sequence, side) pairs whose replayed log-probs differ "
                  "from the recorded ones: the replay is not the run (weights, configuration or engine changed)",
                  departures=bad[:20])


def probe_identity(rp: LocalReplay) -> dict[str, Any]:
    td, problems = rp.train_data, []
    for s in rp.selected:
        ids, mask = td["token_ids"][s], td["response_mask"][s]
        where = torch.nonzero(mask).flatten().tolist()
        prompt, resp = rp.prompts[s], rp.rollout_outputs[s]
        lp, n = len(prompt), len(resp)
        if where != list(range(lp, lp + n)):
            problems.append(f"sequence {s}: the loss mask covers positions {where[:3]}..{where[-1:]} ({len(where)}), "
                            f"the response is positions {lp}..{lp + n - 1} ({n})")
        if ids[:lp].tolist() != prompt:
            problems.append(f"sequence {s}: train-data's prompt tokens are not the request's prompt")
        if ids[lp:lp + n].tolist() != resp:
            problems.append(f"sequence {s}: train-data's response tokens are not the tokens the rollout sampled")
        for side in ("train", "rollout"):  # the ids each side's log-prob op was given, at its own positions
            got = rp.dumps[side].points.get("final.targets", {})
            if [int(got[k]) for k in sorted(k for k in got if k[0] == s)] != resp:
                problems.append(f"sequence {s}: the {side} side's log-prob targets are not the sampled response")
        if rp.train_targets[s] != resp:
            problems.append(f"sequence {s}: the trainer's shifted targets are not the sampled response")
        if rp.train_positions[s] != list(range(lp - 1, lp + n - 1)):
            problems.append(f"sequence {s}: the trainer's log-prob rows are positions {rp.train_positions[s][:3]}.., "
                            f"the response slice is {lp - 1}..{lp + n - 2}")
        roll_rows = sorted(k[1] for k in rp.dumps["rollout"].points.get("final.logprobs", {}) if k[0] == s)
        if roll_rows != rp.train_positions[s]:
            problems.append(f"sequence {s}: the rollout's log-prob positions differ from the trainer's")
        if not (len(rp.rollout_logprobs[s]) == len(rp.train_logprobs[s]) == int(mask.sum()) == n):
            problems.append(f"sequence {s}: response slice lengths differ (rollout {len(rp.rollout_logprobs[s])}, "
                            f"train {len(rp.train_logprobs[s])}, mask {int(mask.sum())}, response {n})")
    if problems:
        return _probe(1, "sample and token identity", FAIL, problems[0], problems=problems[:20])
    return _probe(1, "sample and token identity", PASS, "prompt, response tokens, loss mask, shifted targets, "
                  "positions and response slice agree for every selected sequence",
                  sequences=rp.selected)


def probe_model_state(rp: LocalReplay) -> dict[str, Any]:
    if rp.weights_state is not None:
        return _frameworks_model_state(rp)
    wc = rp.weights_check
    roll, train = weights_sha256(rp.sides["rollout"].weights), weights_sha256(rp.sides["train"].weights)
    ev = {**wc, "rollout_weights": roll, "train_weights": train}
    if wc.get("recorded") != wc.get("loaded"):
        return _probe(2, "model state", FAIL, f"the round's weights are not the run's ({wc['what']}: "
                      f"{wc.get('recorded')} recorded, {wc.get('loaded')} loaded)", **ev)
    if roll != train:
        return _probe(2, "model state", FAIL, "the two sides compute with different weight bits (weight sync)", **ev)
    return _probe(2, "model state", PASS, f"weights from the {wc['source']} match the recorded hash; both sides "
                  "compute with the same bits", **ev)


def _frameworks_model_state(rp: LocalReplay) -> dict[str, Any]:
    """Probe 2 on the frameworks engine: the round's weights against the run's record, then what vLLM computes with
    (read back after the weight sync) against what Megatron exported (:func:`attribute_frameworks.vllm_weights_check`):
    bytes for BF16, the re-quantization of the exported BF16 for an FP8 rollout."""
    wc, ws = rp.weights_check, rp.weights_state
    v = ws["vllm"]
    ev = {**wc, **ws}
    if wc.get("recorded") != wc.get("loaded"):
        return _probe(2, "model state", FAIL, f"the round's weights are not the run's ({wc['what']}: "
                      f"{wc.get('recorded')} recorded, {wc.get('loaded')} loaded)", **ev)
    if v["differ"] or v["missing_in_export"] or v["not_in_vllm"]:
        what = (f"{len(v['differ'])} vLLM parameters differ from Megatron's export (e.g. {v['differ'][:3]})"
                if v["differ"] else f"the export and vLLM's parameters do not match by name (vLLM only: "
                f"{v['missing_in_export'][:3]}, export only: {v['not_in_vllm'][:3]})")
        return _probe(2, "model state", FAIL, f"the two sides compute with different weights: {what}", **ev)
    if ws["quantization"] == "fp8":
        if not v["fp8_layers"]:
            return _probe(2, "model state", FAIL, "an FP8 rollout whose vLLM model has no FP8 layer", **ev)
        return _probe(2, "model state", PASS, f"weights from the {wc['source']} match the recorded hash; vLLM's "
                      f"{v['equal']} BF16 parameters equal Megatron's export byte for byte and its {v['fp8_layers']} "
                      "FP8 linear layers are exactly the re-quantization of the exported BF16 weights (the rollout "
                      "computes with FP8: the first GEMM is where the quantization knob acts)", **ev)
    return _probe(2, "model state", PASS, f"weights from the {wc['source']} match the recorded hash; all "
                  f"{v['equal']} vLLM parameters equal Megatron's export byte for byte", **ev)


def _logit_keys(rp: LocalReplay) -> list[tuple[int, int]]:
    return sorted(set(rp.dumps["train"].points.get("final.logits", {})) &
                  set(rp.dumps["rollout"].points.get("final.logits", {})))


def _targets(rp: LocalReplay, keys: list[tuple[int, int]]) -> torch.Tensor:
    ids = rp.train_data["token_ids"]
    return torch.tensor([int(ids[s, p + 1]) for s, p in keys], dtype=torch.long)


def probe_logits(rp: LocalReplay, keys: list[tuple[int, int]]) -> dict[str, Any]:
    a = rp.dumps["train"].stacked("final.logits", keys)
    b = rp.dumps["rollout"].stacked("final.logits", keys)
    st = diff_stats(a, b)
    status = PASS if st["equal"] else FAIL
    return _probe(3, "pre-softmax logits", status, "the trainer's logits equal the rollout's bit for bit at every "
                  "selected position" if st["equal"] else f"logits differ at {st['mismatches']} of {st['elements']} "
                  f"elements (max |diff| {st['max_abs_diff']:.3g})", positions=len(keys), **st)


def _kept_masks(rp: LocalReplay, keys: list[tuple[int, int]]) -> dict[str, torch.Tensor | None]:
    out: dict[str, torch.Tensor | None] = {}
    for side in ("train", "rollout"):
        logits = rp.dumps[side].stacked("final.logits", keys)
        z, _ = rp.sides[side].ops.kept_set(logits, [rp.sampling] * len(keys))
        out[side] = torch.isfinite(z) if _filtered(rp) else None
    return out


def _filtered(rp: LocalReplay) -> bool:
    return bool((rp.manifest.get("sampling") or {}).get("filtered"))


def probe_lse(rp: LocalReplay, keys: list[tuple[int, int]], masks: dict[str, torch.Tensor | None]) -> dict[str, Any]:
    target = _targets(rp, keys)
    temp = float(rp.sampling.temperature)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for side in ("train", "rollout"):
        z = rp.dumps[side].stacked("final.logits", keys).float() / temp
        mask = masks[side] if rp.sides[side].processed else None
        if mask is not None:
            z = z.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(z, -1)
        sel = z.gather(-1, target[:, None])[:, 0]
        logp = rp.dumps[side].stacked("final.logprobs", keys)
        parts[side] = {"lse": lse, "selected": sel, "logp": logp, "residual": (logp.double() - (sel - lse).double())}
    ev = {k: diff_stats(parts["train"][k], parts["rollout"][k]) for k in ("lse", "selected", "logp")}
    ev["op_vs_formula"] = {side: float(parts[side]["residual"][torch.isfinite(parts[side]["residual"])].abs().max())
                           if torch.isfinite(parts[side]["residual"]).any() else None for side in parts}
    if all(ev[k]["equal"] for k in ("lse", "selected", "logp")):
        return _probe(4, "log-sum-exp and selected logit", PASS, "log-sum-exp, selected logit and log-prob agree bit "
                      "for bit", **ev)
    which = [k for k in ("selected", "lse", "logp") if not ev[k]["equal"]]
    if ev["lse"]["equal"] and ev["selected"]["equal"]:
        detail = ("log-sum-exp and the selected logit agree (computed the same way from each side's logits) but the "
                  "log-probs differ: the sides' log-prob ops differ (log-softmax / selection)")
    else:
        detail = f"differ: {', '.join(which)} (from the logits: see probe 3)"
    return _probe(4, "log-sum-exp and selected logit", FAIL, detail, **ev)


def probe_tp(rp: LocalReplay) -> dict[str, Any]:
    if rp.tensor_parallel == 1:
        return _probe(5, "vocab-parallel reduce per TP rank", TRIVIAL, "TP 1: the vocabulary is not split, there is "
                      "no cross-rank reduce to compare (rlk's sharded merge is measured in probe 7 at TP 2/4/8)")
    return _probe(5, "vocab-parallel reduce per TP rank", NA, f"TP {rp.tensor_parallel}: needs each rank's "
                  "partials (max, sum, selected logit) from both sides; this engine does not dump them yet")


def probe_kept(rp: LocalReplay, keys: list[tuple[int, int]], masks: dict[str, torch.Tensor | None]) -> dict[str, Any]:
    sampling = rp.manifest.get("sampling") or {}
    metrics = _round_metrics(rp)
    ev: dict[str, Any] = {"sampling": sampling, "kept_set_mismatches_recorded": metrics.get("kept_set_mismatches")}
    if not sampling.get("filtered"):
        return _probe(6, "kept token sets", TRIVIAL, "no top-p / top-k / min-p: both sides keep the whole vocabulary",
                      **ev)
    roll_sem, train_sem = (sampling.get("rollout") or {}).get("logprobs"), (sampling.get("train") or {}).get("logprobs")
    if roll_sem != train_sem:
        return _probe(6, "kept token sets", FAIL, f"semantic: the rollout records {roll_sem} log-probs (over its kept "
                      f"set), the trainer {train_sem} ones — not the same distribution under a filter", **ev)
    a, b = masks["train"], masks["rollout"]
    differ = (a != b).any(-1)
    logits_equal = (rp.dumps["train"].stacked("final.logits", keys).view(-1).ne(
        rp.dumps["rollout"].stacked("final.logits", keys).view(-1)).reshape(len(keys), -1).any(-1) == 0)
    definition = differ & logits_equal  # the same logits, different sets: the filters are not the same definition
    target = _targets(rp, keys)
    outside = int((~a.gather(-1, target[:, None])[:, 0]).sum())
    ev.update({"positions": len(keys), "sets_differ": int(differ.sum()),
               "differ_with_equal_logits": int(definition.sum()), "sampled_outside_train_set": outside,
               "sizes": {"train_mean": float(a.sum(-1).float().mean()),
                         "rollout_mean": float(b.sum(-1).float().mean())}})
    if int(definition.sum()):
        return _probe(6, "kept token sets", FAIL, f"semantic: at {int(definition.sum())} positions the two sides' "
                      "filters keep different sets from the same logits (the filters are not one definition)", **ev)
    if int(differ.sum()):
        return _probe(6, "kept token sets", DRIFT, f"the sets differ at {int(differ.sum())} positions, each one whose "
                      "logits already differ: a consequence of the numerical drift upstream, not of the filter", **ev)
    return _probe(6, "kept token sets", PASS, "both sides keep the same token set at every selected position", **ev)


def _round_metrics(rp: LocalReplay) -> dict[str, Any]:
    path = rp.run_dir / evidence.METRICS
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip() and json.loads(line).get("round") == rp.round:
                return json.loads(line)
    return {}


def ab_inputs(rp: LocalReplay, keys: list[tuple[int, int]]) -> abtest.ABInputs:
    """The captured tensors: the trainer's final hidden states at the selected log-prob positions, its LM head,
    the targets, the temperature and the trainer's kept set (rlk's threshold)."""
    from rlk_core.ops import kept_set, linear

    hidden = rp.dumps["train"].stacked("final.norm", keys)
    weight = lm_head(rp.sides["train"]).detach().cpu()
    temp = torch.full((len(keys),), float(rp.sampling.temperature))
    value = token_id = None
    if _filtered(rp):
        s = rp.sampling
        ks = kept_set(linear(hidden, weight), temp, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p)
        value, token_id = ks.value, ks.token_id
    tp = tuple(t for t in (1, 2, 4, 8) if abtest._shardable(weight.shape[0], t))
    return abtest.ABInputs(hidden, weight, _targets(rp, keys), temp, value, token_id, tp,
                           {"kind": "captured", "run_id": rp.manifest.get("run_id"), "round": rp.round,
                            "sequences": rp.selected, "side": "train", "point": "final.norm"})


def probe_ab(report: dict[str, Any]) -> dict[str, Any]:
    groups = abtest.bitwise_groups(report)
    rlk = [r["impl"] for r in report["rows"] if r["kind"] == "rlk"]
    together = any(set(rlk) <= set(g) for g in groups)
    status = PASS if together else FAIL
    return _probe(7, "native vs rlk vs backends on fixed tokens", status,
                  "every rlk path (fused, unfused, vocab-sharded) agrees bit for bit" if together else
                  "rlk's own paths disagree: a contract violation in rlk", groups=groups,
                  table=[{k: r[k] for k in ("impl", "logp_error", "forward_deterministic", "backward_deterministic")}
                         for r in report["rows"]])


# -- the verdict ---------------------------------------------------------------------------------------------------
def verdict(probes: list[dict[str, Any]], layers: dict[str, Any], plan: dict[str, str] | None = None
            ) -> dict[str, Any]:
    blocking = [p for p in probes if p["id"] in BLOCKING and p["status"] == FAIL]
    b = layers["boundary"]
    if blocking:
        return {"kind": "blocked", "boundary": None, "blocked_by": [p["id"] for p in blocking],
                "summary": f"no operator is blamed: probe {blocking[0]['id']} ({blocking[0]['name']}) fails — "
                           f"{blocking[0]['detail']}. Fix that first.",
                "first_difference_unattributed": b and b["point"]}
    if b is None:
        return {"kind": "no_boundary", "boundary": None,
                "summary": "the two sides agree bit for bit at every recorded point, logits and log-probs included"}
    boundary = {"point": b["point"], "layer": layer_of(b["point"]), "operator": operator_of(b["point"]),
                "module": b["module"], "train_ops": b["train_ops"], "rollout_ops": b["rollout_ops"],
                "first_row": b["first_row"], "mismatches": b.get("mismatches"), "elements": b.get("elements"),
                "max_abs_diff": b.get("max_abs_diff")}
    case = (plan or {}).get(b["module"])  # "X/Y": the train side's case, then the rollout side's
    if case:
        boundary["cases"] = dict(zip(("train", "rollout"), case.split("/"), strict=True))
    sides = {s: "/".join(b[f"{s}_ops"]) + (f" ({boundary['cases'][s]})" if case else "") for s in ("train", "rollout")}
    where = f"layer {boundary['layer']}" if boundary["layer"] is not None else "after the last layer"
    return {"kind": "boundary", "boundary": boundary,
            "summary": f"the bits part at {b['point']} ({where}, operator {boundary['operator']}, module "
                       f"{b['module']}: train {sides['train']} vs rollout {sides['rollout']}); "
                       "every point before it agrees bit for bit"}


def attribute(run_dir: Path, rnd: int = 0, sequences: list[int] | None = None, injection: Injection | None = None,
              frameworks: tuple[str, ...] = (), repeats: int = 3, max_sequences: int = 4) -> tuple[dict, LocalReplay,
                                                                                                     abtest.ABInputs]:
    """The attribution of round ``rnd`` of ``run_dir`` (the first ``max_sequences`` sequences unless
    ``sequences``): the report and what it was computed from."""
    threads = torch.get_num_threads()
    recorded = ((read_manifest(run_dir).get("config") or {}).get("threads"))
    if recorded:  # the run's intra-op threads (its bits do not depend on them; its timings and CPU overhead do)
        torch.set_num_threads(int(recorded))
    try:
        return _attribute(run_dir, rnd, sequences, injection, frameworks, repeats, max_sequences)
    finally:
        torch.set_num_threads(threads)


def _attribute(run_dir: Path, rnd: int, sequences: list[int] | None, injection: Injection | None,
               frameworks: tuple[str, ...], repeats: int, max_sequences: int) -> tuple[dict, LocalReplay,
                                                                                       abtest.ABInputs]:
    engine = read_manifest(run_dir).get("engine")
    if engine == "frameworks":  # before anything is read: where the replay cannot run, say so
        from rlk_repro.attribute_frameworks import replayable

        replayable(run_dir, read_manifest(run_dir))
    if sequences is None:
        from rlk_repro.attribute_local import read_train_data

        sequences = list(range(min(max_sequences, int(read_train_data(run_dir, rnd)["token_ids"].shape[0]))))
    if engine == "frameworks":  # real vLLM + megatron-core on the GPU, forward hooks (attribute_frameworks)
        from rlk_repro.attribute_frameworks import replay_frameworks

        rp = replay_frameworks(run_dir, rnd, sequences, injection)
    else:
        rp = replay_local(run_dir, rnd, sequences, injection)
    if injection is not None and rp.weights_state is not None and not _injected(rp):
        raise RlkConfigError(f"--inject {injection.side}:{injection.layer}:{injection.point}: no hook of that side "
                             "ran at that point (points read from a module's input are not injectable on the "
                             "frameworks engine)")
    doc, inputs = report(rp, injection, frameworks, repeats, "cuda" if rp.weights_state is not None else "cpu")
    return doc, rp, inputs


def report(rp: LocalReplay, injection: Injection | None = None, frameworks: tuple[str, ...] = (), repeats: int = 3,
           device: str = "cpu") -> tuple[dict, abtest.ABInputs]:
    """The attribution report of a replay (either engine's): the probes, the walk, the verdict; and probe 7's
    captured tensors (run on ``device``)."""
    n_layers = rp.model_cfg.num_hidden_layers
    for side, seen in rp.layers_seen.items():
        if seen != n_layers:
            raise RuntimeError(f"tap: the {side} side ran {seen} layers, the model has {n_layers}")
    keys = _logit_keys(rp)
    masks = _kept_masks(rp, keys)
    inputs = ab_inputs(rp, keys)
    ab = abtest.run_ab(inputs, frameworks=frameworks, repeats=repeats, device=device)
    probes = [probe_fidelity(rp, injection), probe_identity(rp), probe_model_state(rp), probe_logits(rp, keys),
              probe_lse(rp, keys, masks), probe_tp(rp), probe_kept(rp, keys, masks), probe_ab(ab)]
    layers = compare_dumps(rp.dumps["train"], rp.dumps["rollout"], n_layers)
    doc = {"schema": ATTRIBUTION_SCHEMA, "run_dir": str(rp.run_dir), "run_id": rp.manifest.get("run_id"),
           "engine": rp.manifest.get("engine"), "plan": rp.manifest.get("plan"), "round": rp.round,
           "sequences": rp.selected, "positions_compared": len(keys),
           "injection": None if injection is None else {"side": injection.side, "point": injection.label},
           "weights": rp.weights_check["source"], "replay_notes": rp.replay_notes, "probes": probes,
           "layers": layers, "ab": ab,
           "verdict": verdict(probes, layers, rp.manifest.get("plan"))}
    return doc, inputs


def _injected(rp: LocalReplay) -> bool:
    return rp.injected


def attribute_dumps(train_path: Path, rollout_path: Path) -> dict[str, Any]:
    """The per-layer comparison of two dumps an engine produced itself (``rlk.attribution-dump.v1``: a framework
    engine's hooks, or an earlier attribution's ``dumps/``). Probes 0-2 and 6 cannot run on dumps alone, so the
    first difference is reported and not attributed (verdict ``unchecked``)."""
    from rlk_repro.attribute_dumps import load_dump

    try:
        train, rollout = load_dump(train_path), load_dump(rollout_path)
    except (OSError, ValueError, KeyError) as exc:
        raise RlkConfigError(f"--dumps: {exc}") from None
    if (train.side, rollout.side) != ("train", "rollout"):
        raise RlkConfigError(f"--dumps TRAIN ROLLOUT: the files are the {train.side} and {rollout.side} sides")
    found = [layer_of(label) for label in (*train.points, *rollout.points)]
    n_layers = max((x for x in found if x is not None), default=-1) + 1
    layers = compare_dumps(train, rollout, n_layers)
    probes = [_probe(pid, name, NA, "dumps only: this probe needs the run (its train-data, manifest and weights)")
              for pid, name in ((0, "replay fidelity"), (1, "sample and token identity"), (2, "model state"),
                                (6, "kept token sets"))]
    b = layers["boundary"]
    v = ({"kind": "no_boundary", "boundary": None, "summary": "the two dumps agree bit for bit at every point both "
          "hold" + (f" ({len(layers['missing'])} points missing from one side)" if layers["missing"] else "")}
         if b is None else
         {"kind": "unchecked", "boundary": None, "first_difference_unattributed": b["point"],
          "summary": f"the dumps first differ at {b['point']}; not attributed: probes 0, 1, 2 and 6 need the run"})
    return {"schema": ATTRIBUTION_SCHEMA, "dumps": {"train": str(train_path), "rollout": str(rollout_path)},
            "layers_found": n_layers, "probes": probes, "layers": layers, "verdict": v}


def write(doc: dict[str, Any], rp: LocalReplay, inputs: abtest.ABInputs, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=False)
    (out / "dumps").mkdir()
    for side, dump in rp.dumps.items():
        save_dump(dump, out / "dumps" / f"{side}.safetensors")
    abtest.save_inputs(inputs, out / "ab-tensors.safetensors")
    evidence.write_json_atomic(out / "attribution.json", _jsonable(doc))
    (out / "attribution.md").write_text(markdown(doc), encoding="utf-8")


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, float) and x in (float("inf"), float("-inf")):
        return str(x)
    return x


def default_output(run_dir: Path, rnd: int) -> Path:
    return run_dir.parent / f"{run_dir.name}.attribution-r{rnd}"


def check_output(out: Path, run_dir: Path) -> None:
    if out.exists():
        raise RlkConfigError(f"{out} exists; an attribution never writes into an existing directory (--output)")
    if run_dir.resolve() in out.resolve().parents or out.resolve() == run_dir.resolve():
        raise RlkConfigError(f"--output {out} is inside the run directory (append-only, maybe sealed)")


def _g(x: Any) -> str:
    return "—" if x is None else (f"{x:.3g}" if isinstance(x, float) else str(x))


def markdown(doc: dict[str, Any]) -> str:
    v = doc["verdict"]
    lines = [f"# Attribution of {doc['run_id']} (round {doc['round']})", "",
             f"engine {doc['engine']}, plan {doc['plan']}, sequences {doc['sequences']}, "
             f"{doc['positions_compared']} log-prob positions, weights from the {doc['weights']}"
             + (f"; injected: one ulp at {doc['injection']['point']} on {doc['injection']['side']}"
                if doc["injection"] else ""), "",
             f"**Verdict ({v['kind']}):** {v['summary']}", ""]
    lines += [f"Replay: {note}." for note in doc.get("replay_notes") or ()] + (
        [""] if doc.get("replay_notes") else [])
    if v.get("first_difference_unattributed"):
        lines += [f"(The first difference in the dumps is at {v['first_difference_unattributed']}; not attributed "
                  "while "
                  "the probe above fails.)", ""]
    lines += ["## Probes", "", "| # | probe | status | detail |", "|---|---|---|---|"]
    lines += [f"| {p['id']} | {p['name']} | {p['status']} | {p['detail']} |" for p in doc["probes"]]
    lines += ["", "## Residual stream through the stack", "",
              "| point | bitwise | mismatch fraction | max abs | mean abs | max rel |", "|---|---|---|---|---|---|"]
    for g in doc["layers"]["residual_growth"]:
        lines.append(f"| {g['point']} | {'yes' if g['equal'] else 'no'} | {_g(g['mismatch_fraction'])} | "
                     f"{_g(g['max_abs_diff'])} | {_g(g['mean_abs_diff'])} | {_g(g['max_rel_diff'])} |")
    b = doc["layers"]["boundary"]
    if b is not None:
        lines += ["", f"First differing point: `{b['point']}` (train {b['train_ops']}, rollout {b['rollout_ops']}), "
                  f"{b.get('mismatches')} of {b.get('elements')} elements, max |diff| {_g(b.get('max_abs_diff'))}, "
                  f"first at (sequence, position) {b.get('first_row')}."]
    if doc["layers"]["missing"]:
        lines += ["", f"Points not dumped by both sides: {', '.join(doc['layers']['missing'])}"]
    lines += ["", "## Operator A/B on the captured tokens (probe 7)", "", abtest.markdown(doc["ab"], level=3)]
    return "\n".join(lines) + "\n"
