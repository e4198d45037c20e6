"""The local engine's side of the attribution: replay one round of a run directory on both sides with an operator
tap, and return what each side computed at every point (:mod:`rlk_repro.attribute_dumps`).

The replay is the run itself, not an imitation of it: the round's requests are rebuilt from the manifest's
configuration exactly as :func:`rlk_repro.engine.local.run_local` built them (same prompts, limits, arrival steps,
seeds), the rollout engine generates them with the same continuous-batching schedule, and the trainer recomputes
them packed as its step did. The weights are the round's: round 0 starts from the manifest's checkpoint (or the
seeded random preset), a static-weights run keeps them every round, and the round a saved round state names
(``round-state/``) starts from that state's master weights; any other round is refused (its weights were not
kept). Because both engines are deterministic, the replay reproduces the run's recorded tokens and log-probs bit for
bit — :mod:`rlk_repro.attribute` checks that (``replay fidelity``) before it reads anything into the dumps.

:class:`TapOps` is the hook: an :class:`~rlk_repro.model.ops.Ops` whose every operator records its output (and the
norms their input: the residual stream) under the point it computes, found from the call order of
:mod:`rlk_repro.model.qwen3`'s blocks. An :class:`Injection` perturbs one point on one side by one ulp — the
attribution's own positive control (``rlk-repro attribute --inject``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import load_file

from rlk_core.errors import RlkConfigError
from rlk_core.ops.rope import reserve_tables
from rlk_core.readback import ReadbackRecorder
from rlk_repro.attribute_dumps import Dump
from rlk_repro.engine import local
from rlk_repro.engine.prompts import load_prompt_set
from rlk_repro.engine.rollout import RolloutEngine
from rlk_repro.engine.trainer import Trainer
from rlk_repro.model import qwen3
from rlk_repro.model.config import Qwen3Config, preset
from rlk_repro.model.ops import Ops
from rlk_repro.model.weights import Weights
from rlk_repro.resume import STATE_DIR, STATE_DOC, STATE_FILE, recorded_config
from rlk_repro.runs import file_sha256
from rlk_validate import evidence

# (module, op, occurrence within the layer) -> point name; the order of rlk_repro.model.qwen3's blocks
_NAMES = {
    ("attention", "rms_norm", 0): "attention.input_norm", ("attention", "rms_norm", 1): "attention.q_norm",
    ("attention", "rms_norm", 2): "attention.k_norm", ("attention", "linear", 0): "attention.qkv",
    ("attention", "linear", 1): "attention.o_proj", ("attention", "rope", 0): "attention.rope_q",
    ("attention", "rope", 1): "attention.rope_k", ("ffn", "rms_norm", 0): "ffn.post_norm",
    ("ffn", "linear", 0): "ffn.gate_up", ("ffn", "linear", 1): "ffn.down", ("ffn", "swiglu", 0): "ffn.swiglu",
}
INJECTABLE = sorted({*_NAMES.values(), "attention.core"})


@dataclass(frozen=True)
class Injection:
    """Perturb point ``layers.<layer>.<point>`` on ``side`` by one ulp (every element, towards +inf)."""

    side: str
    layer: int
    point: str

    @classmethod
    def parse(cls, text: str) -> Injection:
        try:
            side, layer, point = text.split(":")
            inj = cls(side, int(layer), point)
        except ValueError:
            raise RlkConfigError(f"--inject {text!r}: expected SIDE:LAYER:POINT, e.g. train:1:ffn.swiglu") from None
        if side not in ("train", "rollout"):
            raise RlkConfigError(f"--inject {text!r}: side must be train or rollout")
        if point not in INJECTABLE:
            raise RlkConfigError(f"--inject {text!r}: point must be one of {', '.join(INJECTABLE)}")
        return inj

    @property
    def label(self) -> str:
        return f"layers.{self.layer}.{self.point}"


def _one_ulp_up(y: torch.Tensor) -> torch.Tensor:
    bumped = torch.nextafter(y.detach(), torch.full_like(y.detach(), float("inf")))
    return y + (bumped - y.detach())


class TapOps(Ops):
    """An operator table that records every output into ``dump`` (rows keyed by ``(sequence, position)``); a step
    of the engine is framed by :meth:`begin` (the keys of the step's token rows and of its log-prob rows) and
    :meth:`end` (which sorts each point's rows onto those keys and keeps the selected sequences')."""

    def __init__(self, plan, side: str, recorder: ReadbackRecorder, dump: Dump, selected: set[int],
                 injection: Injection | None = None) -> None:
        super().__init__(plan, side, recorder)
        self.dump, self.selected = dump, selected
        self.injection = injection if injection is not None and injection.side == side else None
        self.layers_seen = 0
        self._token_keys: list[tuple[int, int]] = []
        self._logit_keys: list[tuple[int, int]] = []
        self._pending: dict[str, list[tuple[str, torch.Tensor]]] = {}
        self._layer, self._attn_norms, self._occ = -1, 0, {}

    def begin(self, token_keys: list[tuple[int, int]], logit_keys: list[tuple[int, int]]) -> None:
        self._token_keys, self._logit_keys = token_keys, logit_keys
        self._pending, self._layer, self._attn_norms, self._occ = {}, -1, 0, {}

    def end(self) -> None:
        for label, parts in self._pending.items():
            rows = torch.cat([t for _, t in parts]) if len(parts) > 1 else parts[0][1]  # decode rows, then prefill
            n = rows.shape[0]
            # equal counts mean the same keys: every scheduled request ran one token and completed (rollout), or
            # every prompt is one token long (train)
            if n == len(self._token_keys):
                keys = self._token_keys
            elif n == len(self._logit_keys):
                keys = self._logit_keys
            else:
                raise RuntimeError(f"tap: point {label} has {n} rows; the step has {len(self._token_keys)} token rows "
                                   f"and {len(self._logit_keys)} log-prob rows")
            keep = [i for i, k in enumerate(keys) if k[0] in self.selected]
            if keep:
                self.dump.add(label, {op for op, _ in parts}, [keys[i] for i in keep],
                              rows[torch.tensor(keep, device=rows.device)])
        self.layers_seen = max(self.layers_seen, self._layer + 1)
        self._pending = {}

    def _put(self, label: str, op: str, y: torch.Tensor) -> torch.Tensor:
        if self.injection is not None and label == self.injection.label:
            y = _one_ulp_up(y)
        self._pending.setdefault(label, []).append((op, y.detach()))
        return y

    def _point(self, module: str, op: str) -> str:
        occ = self._occ.get((module, op), 0)
        self._occ[(module, op)] = occ + 1
        return f"layers.{self._layer}.{_NAMES[(module, op, occ)]}"

    def rms_norm(self, module, x, w, eps):
        if module == "attention":
            if self._attn_norms % 3 == 0:  # a layer starts with its input norm (then the q and k norms)
                self._layer, self._occ = self._attn_norms // 3, {}
                self._put(f"layers.{self._layer}.residual_in", "residual", x)
            self._attn_norms += 1
        elif module == "ffn":
            self._put(f"layers.{self._layer}.residual_mid", "residual", x)
        else:
            self._put("final.residual", "residual", x)
            return self._put("final.norm", "rms_norm", super().rms_norm(module, x, w, eps))
        return self._put(self._point(module, "rms_norm"), "rms_norm", super().rms_norm(module, x, w, eps))

    def linear(self, module, x, w):
        if module == "logp":
            return self._put("final.logits", "linear", super().linear(module, x, w))
        return self._put(self._point(module, "linear"), "linear", super().linear(module, x, w))

    def swiglu(self, x):
        return self._put(self._point("ffn", "swiglu"), "swiglu", super().swiglu(x))

    def rope(self, x, positions, theta):
        return self._put(self._point("attention", "rope"), "rope", super().rope(x, positions, theta))

    def attention_varlen(self, *args, **kw):
        return self._put(f"layers.{self._layer}.attention.core", "attention_varlen",
                         super().attention_varlen(*args, **kw))

    def attention_decode(self, *args, **kw):
        return self._put(f"layers.{self._layer}.attention.core", "attention_decode",
                         super().attention_decode(*args, **kw))

    def attention_paged_prefill(self, *args, **kw):
        return self._put(f"layers.{self._layer}.attention.core", "attention_paged_prefill",
                         super().attention_paged_prefill(*args, **kw))

    def token_logprobs(self, logits, target, temperature, kept=None):
        self._put("final.targets", "token_logprobs", target)  # the ids this side takes the log-prob of (probe 1)
        return self._put("final.logprobs", "token_logprobs", super().token_logprobs(logits, target, temperature, kept))

    def linear_logprobs(self, hidden, weight, target, temperature, kept=None):
        self._put("final.targets", "linear_logprobs", target)
        if "final.logits" not in self._pending:  # the fused op keeps its logits: this side's GEMM on the same rows
            with torch.no_grad():
                self._put("final.logits", "linear", super().linear("logp", hidden.detach(), weight.detach()))
        return self._put("final.logprobs", "linear_logprobs",
                         super().linear_logprobs(hidden, weight, target, temperature, kept))


class _TapEngine(RolloutEngine):
    """The rollout engine, each step framed for the tap: its token rows are ``(request, position)`` in the batch's
    order, its log-prob rows those of the requests whose known tokens the step completes."""

    def __init__(self, *args, seq_of: dict[int, int], **kw) -> None:
        super().__init__(*args, **kw)
        self.seq_of = seq_of

    def _step(self, batch, stats):
        token_keys, logit_keys = [], []
        for r, n in batch:
            s = self.seq_of[r.rid]
            token_keys += [(s, p) for p in range(r.num_computed, r.num_computed + n)]
            if r.num_computed + n == len(r.tokens):
                logit_keys.append((s, len(r.tokens) - 1))
        self.ops.begin(token_keys, logit_keys)
        out = super()._step(batch, stats)
        self.ops.end()
        return out


@dataclass
class Side:
    """One side of the replay: its plain operator table (no tap: for the probes' extra computations), the weights
    it computed with, its log-prob semantics."""

    name: str
    ops: Ops
    weights: Weights
    processed: bool


@dataclass
class LocalReplay:
    run_dir: Path
    manifest: dict[str, Any]
    config: Any  # LocalRunConfig
    model_cfg: Qwen3Config
    round: int
    weights_check: dict[str, Any]
    train_data: dict[str, torch.Tensor]
    selected: list[int]
    prompts: list[list[int]]  # every request's prompt, as rebuilt
    rollout_outputs: list[list[int]]
    rollout_logprobs: list[torch.Tensor]
    train_logprobs: list[torch.Tensor]
    train_targets: list[list[int]]  # per sequence, the shifted targets of the trainer's response rows
    train_positions: list[list[int]]  # per sequence, the positions of those rows
    dumps: dict[str, Dump]
    sides: dict[str, Side]
    sampling: Any  # SamplingParams of the round's requests (limits aside)
    tensor_parallel: int = 1
    layers_seen: dict[str, int] = field(default_factory=dict)
    weights_state: dict[str, Any] | None = None  # frameworks: what each side computes with (probe 2)
    replay_notes: list[str] = field(default_factory=list)  # how the replay departs from the run, said in the report
    injected: bool = False  # frameworks: an --inject point's hook ran (the taps say so)


def read_manifest(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / evidence.MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RlkConfigError(f"{run_dir}: no readable manifest.json ({exc}); not a run directory") from None


def read_train_data(run_dir: Path, rnd: int) -> dict[str, torch.Tensor]:
    path = run_dir / evidence.TRAIN_DATA_DIR / evidence.train_data_name(rnd, 0)
    if not path.is_file():
        raise RlkConfigError(f"{path}: no train-data for round {rnd}")
    return load_file(str(path))


def _round_weights(run_dir: Path, manifest: dict[str, Any], cfg, rnd: int
                   ) -> tuple[Qwen3Config, Weights, dict[str, Any]]:
    """The weights round ``rnd`` started from, and where they came from with the hash the run recorded for them
    and the hash of what was loaded now (probe 2)."""
    if rnd == 0 or cfg.static_weights:
        model_cfg, weights, digest = local.load_model(cfg)
        source = "checkpoint" if (cfg.checkpoint or cfg.model_path) else "seeded random preset"
        return model_cfg, weights, {"source": source, "recorded": (manifest.get("inputs") or {}).get("checkpoint"),
                                    "loaded": digest, "what": "manifest inputs.checkpoint vs the loaded weights"}
    doc_path = run_dir / STATE_DIR / STATE_DOC
    doc = json.loads(doc_path.read_text(encoding="utf-8")) if doc_path.is_file() else {}
    if doc.get("next_round") != rnd:
        have = ", ".join(str(r) for r in sorted({0, *([doc["next_round"]] if "next_round" in doc else [])}))
        raise RlkConfigError(f"round {rnd}: its starting weights were not kept (the run updates its weights every "
                             f"round and saved a round state for round {doc.get('next_round', 'none')}); "
                             f"replayable rounds: {have}")
    path = run_dir / STATE_DIR / STATE_FILE
    loaded = file_sha256(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    model_dir = cfg.checkpoint or cfg.model_path
    model_cfg = Qwen3Config.from_dir(model_dir) if model_dir else preset(cfg.model)
    return model_cfg, dict(state["master"]), {"source": f"round state ({STATE_DIR}/{STATE_FILE})",
                                              "recorded": doc.get("sha256"), "loaded": loaded,
                                              "what": f"{STATE_DIR}/{STATE_DOC} sha256 vs the state file"}


def replay_local(run_dir: Path, rnd: int, selected: list[int] | None, injection: Injection | None = None
                 ) -> LocalReplay:
    """Replay round ``rnd`` of the local-engine run ``run_dir`` on both sides with the tap; ``selected``: the
    sequences (train-data rows) to dump (None: every sequence of the round)."""
    manifest = read_manifest(run_dir)
    if manifest.get("engine") != "local":
        raise RlkConfigError(f"{run_dir}: a {manifest.get('engine')!r} run; the replay runs local-engine runs (a "
                             "framework engine supplies its own dumps: docs/attribution.md)")
    cfg = local.LocalRunConfig(**recorded_config(SimpleNamespace(manifest=manifest), local.LocalRunConfig))
    device, dtype = local.resolve_device(cfg.device), local.DTYPES[cfg.dtype]
    train_data = read_train_data(run_dir, rnd)
    n_seqs = int(train_data["token_ids"].shape[0])
    selected = list(range(n_seqs)) if selected is None else selected
    bad = [s for s in selected if not 0 <= s < n_seqs]
    if bad:
        raise RlkConfigError(f"sequence {bad[0]} is not in round {rnd} (it has {n_seqs} sequences)")
    torch.manual_seed(cfg.seed)
    model_cfg, weights, weights_check = _round_weights(run_dir, manifest, cfg, rnd)
    ps = load_prompt_set(cfg, model_cfg)
    max_len = max(len(e) for e in ps.encoded) + cfg.max_new_tokens
    plan = cfg.plan
    if any(plan.uses_rlk("attention", side) for side in ("train", "rollout")):
        rows = max(max_len, model_cfg.max_position_embeddings)  # as the engine reserves them (its bits do not change)
        reserve_tables(device, model_cfg.head_dim, model_cfg.rope_theta, rows)
    chosen, requests = local._requests(cfg, SimpleNamespace(prompts=ps.prompts, encoded=ps.encoded), rnd)
    if len(requests) != n_seqs:
        raise RlkConfigError(f"round {rnd}: the manifest's configuration gives {len(requests)} requests, train-data "
                             f"holds {n_seqs} sequences")
    want = set(selected)
    dumps = {"train": Dump("train"), "rollout": Dump("rollout")}

    def recorder(side: str) -> ReadbackRecorder:
        return ReadbackRecorder("local", side, plan, mode="audit")

    roll_ops = TapOps(plan, "rollout", recorder("rollout"), dumps["rollout"], want, injection)
    engine = _TapEngine(model_cfg, weights, roll_ops, device=device, dtype=dtype, page_size=cfg.page_size,
                        chunk_size=cfg.chunk_size, max_num_seqs=cfg.max_num_seqs, max_model_len=max_len, seed=cfg.seed,
                        stop_token_ids=ps.stop_token_ids, logprobs=cfg.logprobs,
                        seq_of={r.rid: i for i, r in enumerate(requests)})
    if rnd > 0 and not cfg.static_weights:  # the KV free list the round started from (block tables, not bits)
        state = torch.load(run_dir / STATE_DIR / STATE_FILE, map_location="cpu", weights_only=True)
        engine.cache.free = list(state["kv_free"])
    engine.generate(requests)

    train_ops = TapOps(plan, "train", recorder("train"), dumps["train"], want, injection)
    trainer = Trainer(model_cfg, weights, train_ops, device=device, dtype=dtype, temperature=cfg.temperature,
                      optimizer=cfg.optimizer, lr=cfg.lr, update=False, sampling=local.sampling_params(cfg),
                      logprobs=cfg.train_semantics)
    seqs = [r.prompt + r.output for r in requests]
    token_keys = [(i, p) for i, s in enumerate(seqs) for p in range(len(s) - 1)]
    rows, logit_keys, targets, positions, start = [], [], [], [], 0
    for i, r in enumerate(requests):
        n = len(r.prompt) + len(r.output) - 1
        pos = list(range(len(r.prompt) - 1, n))
        rows.append(torch.arange(start + pos[0], start + n, device=device) if pos else
                    torch.zeros(0, dtype=torch.long, device=device))
        logit_keys += [(i, p) for p in pos]
        targets.append([seqs[i][p + 1] for p in pos])
        positions.append(pos)
        start += n
    train_ops.begin(token_keys, logit_keys)
    logp = trainer.forward_logprobs(seqs, torch.cat(rows)).detach().cpu()
    train_ops.end()
    per_seq = list(logp.split([len(r.output) for r in requests]))
    sides = {
        "rollout": Side("rollout", Ops(plan, "rollout", recorder("rollout")), engine.weights,
                        cfg.logprobs == "processed"),
        "train": Side("train", Ops(plan, "train", recorder("train")), trainer.export_weights(), trainer.processed),
    }
    return LocalReplay(run_dir=run_dir, manifest=manifest, config=cfg, model_cfg=model_cfg, round=rnd,
                       weights_check=weights_check,
                       train_data=train_data, selected=selected,
                       prompts=[r.prompt for r in requests], rollout_outputs=[list(r.output) for r in requests],
                       rollout_logprobs=[torch.tensor(r.logprobs, dtype=torch.float32) for r in requests],
                       train_logprobs=per_seq, train_targets=targets, train_positions=positions, dumps=dumps,
                       sides=sides, sampling=local.sampling_params(cfg), tensor_parallel=1,
                       layers_seen={"rollout": roll_ops.layers_seen, "train": train_ops.layers_seen})


def lm_head(side: Side) -> torch.Tensor:
    return qwen3.lm_head_weight(side.weights)
