"""The frameworks engine's side of the attribution: replay one round of an ``--engine frameworks`` run on real vLLM
and real megatron-core with forward hooks (:mod:`rlk_repro.attribute_hooks`), and return what each side computed at
every point, in the :class:`~rlk_repro.attribute_local.LocalReplay` the probes read.

The replay is the run's round rebuilt as the run built it: the manifest's configuration, the same model directory
(``config.json``, dummy weights), the same vLLM engine arguments and Megatron trainer, the round's weights (round 0:
the checkpoint or the seeded preset; a later round: the run's saved round state for exactly that round,
``--state-every``), given to vLLM by the same weight sync; then the round's requests (prompts, seeds, limits) through
``LLM.generate`` and the trainer's recompute of the sampled responses, micro-batch by micro-batch as its step ran, with
no update. Two differences from the run, both said in the report: vLLM runs eager (forward hooks do not run inside a
CUDA graph or a compiled graph; the ladder's rungs run eager anyway), and the readbacks go to a scratch directory,
never into the run (append-only). Probe 0 checks that the replay reproduces the run's recorded log-probs bit for bit
before anything is read from the dumps.

Probe 2 (:func:`vllm_weights_check`): the weights the Megatron trainer exports (``hf_weights``: what the weight sync
gives vLLM) against the parameters vLLM computes with, read back from its model after the sync — every BF16 parameter
byte for byte against the export's stacked ``[q; k; v]`` / ``[gate; up]``; under ``--rollout-quantization fp8`` every
FP8 linear layer's weight and scale against :func:`rlk_repro.engine.fp8.quantize_per_tensor` of the export's BF16
tensor (the rollout's weights are a function of the trainer's, not the same bytes). Both sides' weights are hashed
(``sha256`` over names, dtypes, shapes, bytes), and the round's starting weights against the hash the run recorded
(manifest ``inputs.checkpoint``, or the round state's ``sha256``).

TP 1 only (probe 5 and the per-rank dumps at TP > 1 are not built: a column-parallel point would need its shards
gathered); refused with that reason otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from rlk_core.errors import RlkConfigError
from rlk_core.readback import ReadbackRecorder
from rlk_repro.attribute_dumps import Dump
from rlk_repro.attribute_hooks import (
    HookTap,
    install_megatron,
    install_vllm,
    megatron_keys,
    megatron_rows,
    vllm_step_keys,
)
from rlk_repro.attribute_local import Injection, LocalReplay, Side, read_manifest, read_train_data
from rlk_repro.model.ops import Ops
from rlk_repro.resume import STATE_DIR, STATE_DOC, STATE_FILE, recorded_config
from rlk_repro.runs import file_sha256


def pairs_sha256(pairs: Iterable[tuple[str, torch.Tensor]]) -> str:
    """``sha256:<hex>`` over names, dtypes, shapes and raw bytes in sorted name order (as ``weights_sha256``)."""
    h = hashlib.sha256()
    for name, t in sorted(pairs, key=lambda p: p[0]):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "sha256:" + h.hexdigest()


def vllm_names(pairs: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Hugging Face ``(name, tensor)`` pairs of a dense Qwen3 as vLLM's parameters hold them at TP 1: ``q/k/v_proj``
    stacked into ``qkv_proj``, ``gate/up_proj`` into ``gate_up_proj``; every other name as it is."""
    hf = dict(pairs)
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.up_proj.weight")):
            continue
        if name.endswith("self_attn.q_proj.weight"):
            p = name[: -len("q_proj.weight")]
            out[p + "qkv_proj.weight"] = torch.cat([t, hf[p + "k_proj.weight"], hf[p + "v_proj.weight"]])
        elif name.endswith("mlp.gate_proj.weight"):
            p = name[: -len("gate_proj.weight")]
            out[p + "gate_up_proj.weight"] = torch.cat([t, hf[p + "up_proj.weight"]])
        else:
            out[name] = t
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.detach().contiguous().view(torch.uint8), b.detach().contiguous().view(torch.uint8))


def vllm_weights_check(model: torch.nn.Module, exported: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """Probe 2's comparison inside vLLM's worker: the parameters ``model`` computes with against the trainer's
    export (``exported``, Hugging Face pairs). BF16 parameters byte for byte; an FP8 linear layer (``weight_scale``
    beside an ``float8`` weight) against the re-quantization of the exported BF16 tensor. Returns counts, the
    parameters that differ, and both sides' hashes."""
    want = vllm_names(exported)
    params = dict(model.named_parameters())
    equal, differ, requantized, missing, derived = 0, [], 0, [], []
    for name, p in params.items():
        if name.endswith(".weight_scale"):
            continue  # checked with its weight
        if name.endswith("_scale") and name not in want:  # another quantization scale (e.g. a static input scale)
            derived.append(name)
            continue
        ref = want.get(name)
        if ref is None:
            missing.append(name)
            continue
        if p.dtype == torch.float8_e4m3fn and name[: -len("weight")] + "weight_scale" in params:
            from rlk_repro.engine.fp8 import quantize_per_tensor

            q, scale = quantize_per_tensor(ref.to(p.device))
            sp = params[name[: -len("weight")] + "weight_scale"]
            ok = _same(q.t(), p)  # the FP8 weight sync writes q.t() (engine.fp8.load_into_fp8_model)
            ok = ok and _same(scale.reshape(sp.shape).to(sp.dtype), sp)
            requantized += 1
            if not ok:
                differ.append(name)
            continue
        if _same(ref.to(p.device), p):
            equal += 1
        else:
            differ.append(name)
    extra = sorted(set(want) - set(params))
    fp8_bad = sum(1 for n in differ if params[n].dtype == torch.float8_e4m3fn)
    return {"vllm_parameters": len(params), "equal": equal, "fp8_layers": requantized,
            "fp8_requantized_equal": requantized - fp8_bad, "differ": differ[:20], "missing_in_export": missing[:20],
            "other_scales": derived[:20], "not_in_vllm": extra[:20],
            "vllm_sha256": pairs_sha256(params.items()), "export_sha256": pairs_sha256(want.items())}


# -- the Megatron side -----------------------------------------------------------------------------------------
def megatron_dump(trainer, samples: list, selected: set[int], injection: Injection | None = None, seq_ids=None
                  ) -> tuple[Dump, list[torch.Tensor], HookTap]:
    """The trainer's recompute of ``samples`` (``Sample``\\ s; sequence ``i`` = ``samples[i]`` unless ``seq_ids``),
    micro-batch by micro-batch as :meth:`MegatronTrainer.step` runs it (gradients enabled, no backward, no update),
    with every point of the selected sequences dumped. Returns the dump, each sample's log-probs and the tap."""
    dump = Dump("train")
    tap = HookTap("train", dump, selected, injection)
    install_megatron(tap, trainer.model, trainer.cfg, logits=not trainer.r_logp)
    seq_ids = list(range(len(samples))) if seq_ids is None else seq_ids
    per: list[torch.Tensor] = []
    try:
        for idx in trainer.micro_batches(samples):
            mb = [samples[i] for i in idx]
            lens = [len(s.prompt) + len(s.response) - 1 for s in mb]
            seqs = [seq_ids[i] for i in idx]
            tokens, logit_keys = megatron_keys(seqs, lens, [len(s.prompt) for s in mb])
            tap.begin(tokens, logit_keys, megatron_rows(lens, 1 if trainer.r_attention else len(mb)))
            lp = trainer._logprobs(mb)
            if trainer.r_logp:  # the fused op keeps no logits: this side's own LM-head GEMM on the same rows
                from rlk_core.ops import linear

                h = trainer.box["hidden"].detach()
                h = megatron_rows(lens, 1 if trainer.r_attention else len(mb))(h)
                pick = torch.tensor([i for i, k in enumerate(tokens) if k in set(logit_keys)], device=h.device)
                with torch.no_grad():
                    tap._put("final.logits", "rlk.linear", linear(h[pick], trainer.box["weight"].detach()), False)
            tap.end()
            target = [t for s in mb for t in s.response]
            keep = [i for i, k in enumerate(logit_keys) if k[0] in selected]
            if keep:
                sel = torch.tensor(keep)
                dump.add("final.logprobs", {"megatron.logprobs"}, [logit_keys[i] for i in keep],
                         lp.detach().float().cpu()[sel])
                dump.add("final.targets", {"megatron.logprobs"}, [logit_keys[i] for i in keep],
                         torch.tensor(target)[sel])
            per += list(lp.detach().float().cpu().split([len(s.response) for s in mb]))
    finally:
        tap.remove()
    return dump, per, tap


# -- the vLLM side ---------------------------------------------------------------------------------------------
class VllmKeys:
    """Which request of the replay's ``generate`` a vLLM request id is: ``LLM`` numbers its requests from its
    counter (``base`` = the first number of this call), a sample ``i > 0`` of ``n`` is ``<i>_<id>``."""

    def __init__(self, base: int, prompts: int, n: int) -> None:
        self.base, self.prompts, self.n = base, prompts, n

    def seq(self, req_id: str) -> int | None:
        from rlk_vllm_plugin.moe import request_key

        key = request_key(str(req_id))
        if key is None or not key[0].isdigit():
            return None
        p = int(key[0]) - self.base
        return p * self.n + key[1] if 0 <= p < self.prompts and 0 <= key[1] < self.n else None


def _batch_of(runner) -> tuple[list[str], list[int]]:
    """The request ids and query offsets of the forward the runner is about to run: Model Runner V2 keeps the batch
    :meth:`prepare_inputs` returned (stashed by :func:`install_vllm_tap`), the V1 runner its persistent batch."""
    stash = getattr(runner, "_rlk_attribution_batch", None)
    if stash is not None:
        n = int(stash.num_reqs)
        return list(stash.req_ids[:n]), [int(x) for x in stash.query_start_loc_np[:n + 1]]
    n = int(runner.input_batch.num_reqs)
    return list(runner.input_batch.req_ids[:n]), [int(x) for x in runner.query_start_loc.np[:n + 1]]


def install_vllm_tap(worker, tap: HookTap, keys: VllmKeys) -> int:
    """In vLLM's worker (``LLM.collective_rpc``): the tap's hooks on the runner's model, and a pre-hook on the
    model that frames every forward with its rows' keys (the previous forward's frame ends there: its logits are
    computed after the model returns). Returns the number of layers hooked."""
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    layers = install_vllm(tap, model)
    if hasattr(runner, "prepare_inputs") and not hasattr(runner, "input_batch"):  # Model Runner V2
        original = runner.prepare_inputs

        def prepare_inputs(*args, **kwargs):
            batch = original(*args, **kwargs)
            runner._rlk_attribution_batch = batch
            return batch

        runner.prepare_inputs = prepare_inputs

    def frame(mod, args, kwargs):
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        req_ids, qsl = _batch_of(runner)
        if tap._active:
            tap.end()
        pos = positions.reshape(-1)[: qsl[-1]].tolist()
        tap.begin(*vllm_step_keys([keys.seq(r) for r in req_ids], qsl, pos))

    tap.handles.append(model.register_forward_pre_hook(frame, with_kwargs=True))
    return layers


# -- the replay ------------------------------------------------------------------------------------------------
def _round_state(run_dir: Path, rnd: int, manifest: dict[str, Any], ckpt_hash: str) -> tuple[dict | None, dict]:
    if rnd == 0:
        return None, {"source": "checkpoint" if (manifest.get("config") or {}).get("checkpoint") or
                      (manifest.get("config") or {}).get("model_path") else "seeded random preset",
                      "recorded": (manifest.get("inputs") or {}).get("checkpoint"), "loaded": ckpt_hash,
                      "what": "manifest inputs.checkpoint vs the loaded weights"}
    doc_path = run_dir / STATE_DIR / STATE_DOC
    doc = json.loads(doc_path.read_text(encoding="utf-8")) if doc_path.is_file() else {}
    if doc.get("next_round") != rnd:
        raise RlkConfigError(f"round {rnd}: its starting weights were not kept (the run saved a round state for "
                             f"round {doc.get('next_round', 'none')}: --state-every); replayable rounds: 0"
                             + (f", {doc['next_round']}" if "next_round" in doc else ""))
    path = run_dir / STATE_DIR / STATE_FILE
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state, {"source": f"round state ({STATE_DIR}/{STATE_FILE})", "recorded": doc.get("sha256"),
                   "loaded": file_sha256(path), "what": f"{STATE_DIR}/{STATE_DOC} sha256 vs the state file"}


def replayable(run_dir: Path, manifest: dict[str, Any]):
    """The run's ``FrameworksRunConfig``, where this machine can replay it: TP 1 and what ``--engine frameworks``
    needs (a CUDA GPU, vLLM, megatron-core, the plugin and provider); else exits 2 saying what is missing."""
    from rlk_repro.engine import frameworks as fw

    cfg = fw.FrameworksRunConfig(**recorded_config(SimpleNamespace(manifest=manifest), fw.FrameworksRunConfig))
    if cfg.tp != 1:
        raise RlkConfigError(f"{run_dir}: a TP {cfg.tp} frameworks run; the attribution replays TP 1 runs (at TP > 1 "
                             "each rank's column-parallel points and log-prob partials would have to be gathered: "
                             "docs/attribution.md, probe 5)")
    problem = fw.requirements(1)
    if problem:
        raise RlkConfigError(f"attributing a frameworks run replays it: {problem}")
    return cfg


def replay_frameworks(run_dir: Path, rnd: int, selected: list[int] | None, injection: Injection | None = None
                      ) -> LocalReplay:
    """Replay round ``rnd`` of the frameworks run ``run_dir`` on real vLLM and megatron-core (one GPU) with the
    hooks; ``selected``: the train-data rows to dump."""
    from rlk_repro.engine import frameworks as fw
    from rlk_repro.engine.frameworks_megatron import MegatronTrainer, init_model_parallel
    from rlk_repro.engine.frameworks_vllm import VLLM_ENV, VllmRollout, write_model_dir
    from rlk_repro.engine.local import DTYPES, load_model, sampling_params
    from rlk_repro.engine.prompts import load_prompt_set
    from rlk_repro.engine.trainer import Sample

    manifest = read_manifest(run_dir)
    cfg = replayable(run_dir, manifest)
    train_data = read_train_data(run_dir, rnd)
    n_seqs = int(train_data["token_ids"].shape[0])
    selected = list(range(n_seqs)) if selected is None else selected
    bad = [s for s in selected if not 0 <= s < n_seqs]
    if bad:
        raise RlkConfigError(f"sequence {bad[0]} is not in round {rnd} (it has {n_seqs} sequences)")
    from rlk_repro import tp_options

    tp_options.apply_environment(cfg)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    rank, _, device = fw._init_world(cfg)
    scratch = Path(tempfile.mkdtemp(prefix="rlk-attribution-"))
    try:
        os.environ.update(cfg.plan.env())
        os.environ["RL_KERNEL_MODE"] = cfg.readback_mode
        os.environ["RL_KERNEL_READBACK_DIR"] = str(scratch / "readbacks")  # never into the run directory
        os.environ["RL_KERNEL_RUN_ID"] = f"{manifest.get('run_id')}-attribution-r{rnd}"
        for k, v in VLLM_ENV.items():
            os.environ.setdefault(k, v)
        if cfg.logprobs == "unfiltered":
            os.environ["RL_KERNEL_VLLM_UNFILTERED_LOGPROBS"] = "1"
        torch.manual_seed(cfg.seed)
        model_cfg, weights, ckpt_hash = load_model(cfg)
        state, weights_check = _round_state(run_dir, rnd, manifest, ckpt_hash)
        ps = load_prompt_set(cfg, model_cfg)
        max_len = max(len(e) for e in ps.encoded) + cfg.max_new_tokens
        vllm = VllmRollout(write_model_dir(scratch / "model", model_cfg), dtype=cfg.dtype, seed=cfg.seed, tp=1,
                           max_model_len=max_len + 16, gpu_memory_utilization=cfg.gpu_memory_utilization,
                           enforce_eager=True, cuda_graphs=None, attention_r=cfg.plan.uses_rlk("attention", "rollout"),
                           max_num_seqs=cfg.vllm_max_num_seqs, max_num_batched_tokens=cfg.vllm_max_num_batched_tokens,
                           routed_experts=model_cfg.is_moe, quantization=cfg.rollout_quantization)
        init_model_parallel(1, cfg.seed)
        trainer = MegatronTrainer(model_cfg, weights, tp=1, rank=rank, device=device, dtype=DTYPES[cfg.dtype],
                                  temperature=cfg.temperature, optimizer=cfg.optimizer, lr=cfg.lr,
                                  micro_tokens=cfg.train_micro_tokens, sampling=sampling_params(cfg),
                                  processed=cfg.train_semantics == "processed")
        if state is not None:
            trainer.load_round_state(state)
        exported = list(trainer.hf_weights())
        named = dict(exported)
        head = named.get("lm_head.weight", named["model.embed_tokens.weight"])
        sync = vllm.load_weights(exported)
        check = vllm.llm.apply_model(lambda m: vllm_weights_check(m, exported))[0]
        train_hash = pairs_sha256(exported)
        del weights

        chosen, seeds, limits = fw.round_requests(cfg, len(ps.prompts), rnd)
        n = cfg.samples_per_prompt
        roll_dump = Dump("rollout")
        roll_tap = HookTap("rollout", roll_dump, set(selected), injection)
        keys = VllmKeys(vllm.llm.request_counter.counter, len(chosen), n)
        vllm.llm.collective_rpc(lambda worker: install_vllm_tap(worker, roll_tap, keys))
        try:
            roll = vllm.generate([ps.encoded[i] for i in chosen], seeds, limits, n, cfg.temperature, cfg.top_p,
                                 cfg.top_k, cfg.min_p, stop_token_ids=ps.stop_token_ids)
            if roll_tap._active:
                roll_tap.end()
        finally:
            roll_tap.remove()
        comps = roll.completions
        if len(comps) != n_seqs:
            raise RlkConfigError(f"round {rnd}: the replay generated {len(comps)} samples, train-data holds {n_seqs}")
        prompts = [list(ps.encoded[chosen[c.prompt_index]]) for c in comps]
        samples = [Sample(p, list(c.tokens), list(c.logprobs), 0.0) for p, c in zip(prompts, comps, strict=True)]
        train_dump, train_lp, train_tap = megatron_dump(trainer, samples, set(selected), injection)
        vllm.shutdown()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    weights_state = {"train_export_sha256": train_hash, "weight_sync": {k: v for k, v in sync.items()
                                                                        if k != "seconds"},
                     "vllm": check, "quantization": cfg.rollout_quantization}
    return assemble(run_dir, manifest, cfg, model_cfg, rnd, weights_check, train_data, selected, samples, train_dump,
                    train_lp, roll_dump, head, weights_state, {"rollout": roll_tap.layers_seen,
                                                               "train": train_tap.layers_seen},
                    roll_tap.injected or train_tap.injected,
                    ["vLLM ran eager in the replay (forward hooks need it)" + (
                        "" if cfg.enforce_eager else "; the run did not: probe 0 says whether the replay's bits are "
                        "the run's")])


def assemble(run_dir: Path, manifest: dict[str, Any], cfg, model_cfg, rnd: int, weights_check: dict[str, Any],
             train_data: dict[str, torch.Tensor], selected: list[int], samples: list, train_dump: Dump,
             train_lp: list[torch.Tensor], roll_dump: Dump, head: torch.Tensor, weights_state: dict[str, Any],
             layers_seen: dict[str, int], injected: bool, notes: list[str]) -> LocalReplay:
    """The replay the probes read, from what the two sides computed: ``samples`` (``Sample`` objects in train-data
    order: the prompt, the tokens the rollout sampled and the log-probs its sampler returned, which go into the
    rollout's dump at the trainer's positions), the trainer's log-probs ``train_lp``, both dumps, the LM head and
    probe 2's comparison."""
    for s in selected:
        smp, lp = samples[s], len(samples[s].prompt)
        rows = [(s, lp - 1 + j) for j in range(len(smp.response))]
        if rows:
            roll_dump.add("final.logprobs", {"vllm.sampler"}, rows,
                          torch.tensor(smp.rollout_logprobs, dtype=torch.float32))
            roll_dump.add("final.targets", {"vllm.sampler"}, rows, torch.tensor(smp.response))
    plan = cfg.plan
    rec = {side: ReadbackRecorder(fwk, side, plan, mode="audit") for side, fwk in (("train", "megatron"),
                                                                                   ("rollout", "vllm"))}
    head_w = {"lm_head": head.detach().cpu()}
    sides = {"rollout": Side("rollout", Ops(plan, "rollout", rec["rollout"]), head_w, cfg.logprobs == "processed"),
             "train": Side("train", Ops(plan, "train", rec["train"]), head_w, cfg.train_semantics == "processed")}
    from rlk_repro.engine.local import sampling_params

    return LocalReplay(run_dir=run_dir, manifest=manifest, config=cfg, model_cfg=model_cfg, round=rnd,
                       weights_check=weights_check, train_data=train_data, selected=selected,
                       prompts=[list(s.prompt) for s in samples], rollout_outputs=[list(s.response) for s in samples],
                       rollout_logprobs=[torch.tensor(s.rollout_logprobs, dtype=torch.float32) for s in samples],
                       train_logprobs=train_lp, train_targets=[list(s.response) for s in samples],
                       train_positions=[list(range(len(s.prompt) - 1, len(s.prompt) - 1 + len(s.response)))
                                        for s in samples],
                       dumps={"train": train_dump, "rollout": roll_dump}, sides=sides,
                       sampling=sampling_params(cfg), tensor_parallel=1, layers_seen=layers_seen,
                       weights_state=weights_state, injected=injected, replay_notes=notes)
