"""VIME's ``--save-debug-train-data`` dumps (format version 2) as a VIME training job writes them (needs torch).

A job of ``DP x PP x CP x TP`` ranks (Megatron's rank order: TP fastest, then CP, DP, PP) writes one file per rollout,
``{rollout_id}_{rank}.pt``, from the data-parallel source among the ranks that are TP 0 of the last pipeline stage
at CP 0: its payload gathers every data-parallel shard's samples (each sample's context-parallel fields restored to
its whole response), sorted by rollout position, with the shards' layout beside them and the batch's raw rewards.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def writer_rank(dp: int, pp: int, cp: int, tp: int) -> int:
    """The global rank that writes: TP 0, CP 0, DP 0 of the last pipeline stage."""
    return tp * cp * dp * (pp - 1)


def _zigzag_restore(full: torch.Tensor, cp: int) -> torch.Tensor:
    """What VIME's CP gather gives back: the response cut into 2*cp chunks, rank r holding chunks r and 2cp-1-r,
    all-gathered and put back in order."""
    chunks = list(torch.tensor_split(full, 2 * cp))
    held = {r: (chunks[r], chunks[2 * cp - 1 - r]) for r in range(cp)}
    back = [None] * (2 * cp)
    for r, (a, b) in held.items():
        back[r], back[2 * cp - 1 - r] = a, b
    return torch.cat(back)


def payload(rollout_id: int, *, dp: int = 2, pp: int = 2, cp: int = 2, tp: int = 2, per_shard: int = 3,
            drift: float = 0.0, seed: int = 0, gathered: bool = True) -> dict:
    """One rollout's dump. Samples of the rollout batch (``dp * per_shard``) are dealt round-robin to the DP shards
    (``partition``); ``drift`` is subtracted from the training log-probs of the first response token of every
    sample; ``gathered=False`` leaves the log-probs CP-local (what a dump without the gather would hold)."""
    g = torch.Generator().manual_seed(seed * 1000 + rollout_id)
    n = dp * per_shard
    prompt_lens = torch.randint(3, 9, (n,), generator=g).tolist()
    resp_lens = torch.randint(4, 13, (n,), generator=g).tolist()
    raw_reward = [float(x) for x in torch.randint(0, 2, (n,), generator=g)]
    shards = []
    for d in range(dp):
        partition = [i for i in range(n) if i % dp == d]
        data = {"tokens": [], "response_lengths": [], "total_lengths": [], "loss_masks": [], "rewards": [],
                "rollout_log_probs": [], "log_probs": [], "ref_log_probs": [], "advantages": []}
        for i in partition:
            r, t = resp_lens[i], prompt_lens[i] + resp_lens[i]
            roll = -torch.rand(r, generator=g, dtype=torch.float32) * 4 - 0.01
            train = roll.clone()
            train[0] -= drift
            mask = torch.ones(r, dtype=torch.int32)
            mask[-1] = 0  # a truncated last token
            if gathered:
                roll, train = _zigzag_restore(roll, cp), _zigzag_restore(train, cp)
            else:
                roll, train = torch.tensor_split(roll, 2 * cp)[0], torch.tensor_split(train, 2 * cp)[0]
            data["tokens"].append(torch.randint(0, 1000, (t,), generator=g))
            data["response_lengths"].append(r)
            data["total_lengths"].append(t)
            data["loss_masks"].append(mask)
            data["rewards"].append(raw_reward[i] - 0.5)
            data["rollout_log_probs"].append(roll)
            data["log_probs"].append(train)
            data["ref_log_probs"].append(roll.clone())
            data["advantages"].append(torch.full((r,), raw_reward[i] - 0.5))
        data["sample_indices"] = [100 * rollout_id + i for i in partition]
        data["partition"] = partition
        data["micro_batch_indices"] = [[k] for k in range(per_shard)]
        data["num_microbatches"] = [per_shard]
        data["global_batch_sizes"] = [n]
        data["raw_reward"] = raw_reward
        rank = writer_rank(dp, pp, cp, tp) + d * tp * cp
        shards.append({"rank": rank, "data_parallel_rank": d, "rollout_data": data})
    return _dump_payload(shards, rollout_id, writer_rank(dp, pp, cp, tp))


def _dump_payload(shards: list[dict], rollout_id: int, writer: int) -> dict:
    """The payload as format version 2 lays it out: per-sample columns become one dict per sample (ids surfaced as
    rollout_position / sample_index), layout and other non-per-sample columns stay in ``dp_shards``, whole-batch
    raw_reward goes to the top; samples sorted by rollout position."""
    ids = {"sample_indices": "sample_index", "partition": "rollout_position"}
    layout_keys = ("micro_batch_indices", "num_microbatches", "global_batch_sizes")
    samples, layout, top = [], [], {}
    for shard in shards:
        data, n = shard["rollout_data"], len(shard["rollout_data"]["response_lengths"])
        lay = {"rank": shard["rank"], "data_parallel_rank": shard["data_parallel_rank"]}
        lay.update({k: list(data[k]) for k in ids})
        columns = {}
        for k, v in data.items():
            if k in ids:
                continue
            if k == "raw_reward":
                top.setdefault(k, v)
            elif k in layout_keys or len(v) != n:
                lay[k] = v
            else:
                columns[k] = v
        for i in range(n):
            s = {"data_parallel_rank": shard["data_parallel_rank"]}
            s.update({scalar: data[k][i] for k, scalar in ids.items()})
            s.update({k: v[i] for k, v in columns.items()})
            samples.append(s)
        layout.append(lay)
    samples.sort(key=lambda s: s["rollout_position"])
    return {"format_version": 2, "rollout_id": rollout_id, "rank": writer, "samples": samples, "dp_shards": layout,
            **top}


def write_dumps(directory: Path, rollouts: int = 2, **kw) -> list[Path]:
    """``{rollout_id}_{rank}.pt`` for rollouts 0 .. rollouts-1 (torch.save, as VIME's dump)."""
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for rid in range(rollouts):
        p = payload(rid, **kw)
        path = directory / f"{rid}_{p['rank']}.pt"
        torch.save(p, path)
        out.append(path)
    return out


def expected(rollout_id: int, **kw) -> dict:
    """What the comparison must find in one rollout's dump, from the torch payload (torch.ne, as a producer)."""
    p = payload(rollout_id, **kw)
    tokens = mism = 0
    for s in p["samples"]:
        m = s["loss_masks"] != 0
        tokens += int(m.sum())
        mism += int(torch.ne(s["log_probs"][m], s["rollout_log_probs"][m]).sum())
    return {"compared_tokens": tokens, "mismatch_count": mism, "samples": len(p["samples"]),
            "values": {k: np.asarray(p["samples"][0][k]) for k in ("log_probs", "rollout_log_probs", "tokens")}}


COMMITTED = Path(__file__).parent / "data" / "vime-debug"
#: the committed fixture: rollout 0 equal, rollout 1 one ulp-ish apart at the first response token of every sample
COMMITTED_ROLLOUTS = {0: 0.0, 1: 2.0 ** -12}


def write_committed(directory: Path = COMMITTED) -> None:
    """(Re)write the committed dumps and their expected comparison, for the torch-free suite (from the repo root:
    ``python -c 'import sys; sys.path.insert(0, "tests/validate"); import vime_dump_builders as b;
    b.write_committed()'``)."""
    import json

    directory.mkdir(parents=True, exist_ok=True)
    want = {}
    for rid, drift in COMMITTED_ROLLOUTS.items():
        p = payload(rid, drift=drift)
        torch.save(p, directory / f"{rid}_{p['rank']}.pt")
        e = expected(rid, drift=drift)
        want[f"{rid}_{p['rank']}.pt"] = {"compared_tokens": e["compared_tokens"], "mismatch_count": e["mismatch_count"],
                                          "samples": e["samples"],
                                          "first_log_probs": [float(x) for x in e["values"]["log_probs"]]}
    (directory / "expected.json").write_text(json.dumps(want, indent=1) + "\n")
