"""Host syncs of the rlk spec's training step, counted on the CPU as on a CUDA device
(:class:`_opcount.SyncCounter`; its module docstring states which ops sync and how a CPU
run tells device tensors from host ones): the GRPO step of ``benchmarks/frameworks/megatron_gpu.py`` (forward,
log-probs from hidden states + LM head, PPO-clip loss, backward) on the tiny all-R GPTModel.

What remains, on the provider's path:

- **one per packed batch**: ``attention.py:_packed_batch`` reads ``cu_seqlens_q`` to the host (``.tolist()``,
  a device-to-host copy) once per batch — not per layer — to check the offsets, the other offset fields and
  the longest sequence against the model's maximum length (the rope table's size). Positions and the int32
  offsets are made on the device from the given tensor (no copy back). A step on the same batch again: none.
- ``cu_seqlens_kv`` (or ``*_padded``) as *another* tensor than ``cu_seqlens_q`` costs one read more (slime
  passes the same tensor for both: free).
- an sbhd batch (the stock layout): one per causal-mask object (``_check_causal_mask`` compares it with the
  causal mask on the device and reads the verdict).
- slime's log-prob record (``slime_hooks.record_tensors``, evidence runs only): one copy to the host per
  record (train, rollout log-probs and masks together; was one per group).

At TP 2 / CP 2 (``_sync_count_world_worker.py``, two gloo ranks each; the same model, the metadata
check of rlk_collectives modelled as on NCCL: an upload and a read of a small vector per checked call):

- TP: the rlk all-reduces / all-gathers check rank agreement in the first layer only
  (``spec.check_collectives_once``): 4 calls (QKV and fc1 input gradients, output projection and fc2 sums)
  plus the LM-head vocab gather, 2 syncs each, whatever the depth (every layer checking: 4 per layer + 1);
  Megatron's own ``VocabParallelEmbedding`` adds 3 (boolean-mask assignments of out-of-shard ids, forward
  and backward: the stock model has them too);
- CP: the K/V all-gather checks in the first layer only (1 call, 2 syncs); per batch, rlk_collectives'
  ``ZigzagLayout.build`` uploads its two index tensors and ``q_positions`` reads the local rows back and
  uploads the positions (4; listed for rlk_collectives in the report).

Not counted here: syncs inside an rlk op (one kernel on the GPU; none in rlk_core's GPU forward / backward
kernels once the rope table is reserved, which the provider now does at the first forward: without it,
``rlk_core/ops/rope/triton.py:forward_tables`` reads ``int(positions.max())`` per call), and syncs in rlk_core's
CPU reference code outside an op (``rlk_ref``: the CPU path, not the GPU's — e.g. a reference backward
uploading its constants; none with today's rlk_core). The GPU benchmark counts the real syncs
(``megatron_gpu.py`` timing stage, ``host_syncs``; ``test_host_syncs_gpu.py``).

Controls: syncs injected into the provider's layers are counted, each once per call, with the injecting
frame — a device scalar read in every RMSNorm forward, an upload ``torch.tensor(..., device=x.device)`` there,
a ``.cpu()`` inside the QKV weight-gradient backward (a Python backward: the counter keeps its modes there) —
while a ``.tolist()`` of a host tensor there is free.
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _model  # noqa: E402
from test_megatron_provider import MEGATRON_WARNINGS, R_ALL  # noqa: E402

pytestmark = [pytest.mark.megatron, *MEGATRON_WARNINGS]

PACKED_READ = "provider attention.py:_packed_batch tolist (d2h)"


@pytest.fixture(scope="module")
def runs() -> dict:
    return _model.run_worker("_sync_count_worker.py", 29810, R_ALL)


@pytest.fixture(scope="module")
def world() -> dict:
    return _model.run_worker("_sync_count_world_worker.py", 30110, R_ALL)


def _gpu_syncs(run: dict) -> dict[str, int]:
    """``owner file:function op (kind)`` -> count, without line numbers and without ``rlk_ref`` (the CPU
    reference path of an rlk op's backward, not what the GPU runs)."""
    out: dict[str, int] = {}
    for site, n in run["syncs"].items():
        owner, where, rest = site.split(" ", 2)
        if owner == "rlk_ref":
            continue
        key = f"{owner} {where.rsplit(':', 1)[0]} {rest}"
        out[key] = out.get(key, 0) + n
    return out


def test_a_fresh_packed_batch_costs_one_host_sync(runs):
    assert _gpu_syncs(runs["rlk_fresh_batch"]) == {PACKED_READ: 1}
    assert set(runs["rlk_fresh_batch"]["by_owner"]) <= {"provider", "rlk_ref"}


def test_the_same_batch_again_costs_none(runs):
    assert _gpu_syncs(runs["rlk_same_batch"]) == {}


def test_cu_seqlens_kv_as_another_tensor_is_read_once_more(runs):
    assert _gpu_syncs(runs["rlk_kv_other_tensor"]) == {PACKED_READ: 1,
                                                        "provider attention.py:_check_packed tolist (d2h)": 1}


def test_an_sbhd_batch_reads_the_causal_mask_check_once(runs):
    assert _gpu_syncs(runs["rlk_sbhd_new_mask"]) == {
        "provider attention.py:_check_causal_mask aten::_local_scalar_dense (read)": 1}


def test_no_op_mixes_host_and_device_tensors(runs):
    assert all(not r["mixed"] for k, r in runs.items() if isinstance(r, dict) and "mixed" in r)


def test_rope_table_reserved_once_per_layer_for_the_model_length(runs):
    n = runs["layers"]
    assert runs["max_positions"] == [40960]  # megatron_gpu's GPTModel max_sequence_length, set by prepare_model
    assert runs["reserve_calls"] == [["cpu", 16, 1e6, 40960]] * n


def test_a_batch_longer_than_the_model_is_refused(runs):
    assert runs["too_long"] is not None
    assert "48 tokens" in runs["too_long"] and "max_sequence_length 32" in runs["too_long"]
    # without a maximum (prepare_model not called) the same batch runs: rope unreserved, nothing refused
    assert _gpu_syncs(runs["unreserved"]) == {PACKED_READ: 1}


def test_control_injected_syncs_are_counted_with_their_frame(runs):
    c = runs["control_injected"]
    got = _gpu_syncs(c)
    assert c["calls"]["norm"] == 4 * runs["layers"] + 1  # input, q, k, pre-MLP norms per layer + the final norm
    assert c["calls"]["rows_backward"] == runs["layers"]
    assert got == {PACKED_READ: 1,  # the measured batch is not the cached one here
                   "harness _sync_count_worker.py:norm_with_syncs aten::_local_scalar_dense (read)": c["calls"]["norm"],
                   "harness _sync_count_worker.py:norm_with_syncs tensor(data, device=...) (h2d)": c["calls"]["norm"],
                   "harness _sync_count_worker.py:rows_backward_with_sync cpu (d2h)": c["calls"]["rows_backward"]}


def test_stock_step_makes_none_on_this_path(runs):
    assert _gpu_syncs(runs["stock_fresh_batch"]) == {}


def test_positions_from_device_offsets_match_the_host_construction():
    import torch

    from rlk_megatron_provider.attention import _positions

    for lens in ([3, 0, 5, 1], [0, 0, 4], [7], [0, 0], [2, 0, 0]):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        want = torch.cat([torch.arange(n) for n in lens])
        assert torch.equal(_positions(cu, sum(lens)), want), lens


def test_a_logprob_record_costs_one_host_sync():
    import torch
    from _opcount import SyncCounter

    from rlk_megatron_provider.slime_hooks import record_tensors

    train = [torch.randn(3), torch.randn(2)]  # made before the counter: device tensors, as slime's are
    rollout, masks = [torch.randn(3), torch.randn(2)], [torch.ones(3), torch.zeros(2)]
    with SyncCounter() as c:
        rec = record_tensors(train, rollout, masks)
    assert [(s.kind, s.op) for s in c.syncs] == [("d2h", "cpu")]
    assert torch.equal(rec["train_logprobs"], torch.cat(train))
    assert torch.equal(rec["rollout_logprobs"], torch.cat(rollout))
    assert rec["loss_mask"].tolist() == [1, 1, 1, 0, 0] and rec["response_lengths"].tolist() == [3, 2]


CHECK_UP, CHECK_READ = ("collectives _group.py:check_agreement tensor(data, device=...) (h2d)",
                        "collectives _group.py:check_agreement tolist (d2h)")
EMBEDDING_MASKS = {"megatron layers.py:forward aten::index_put_ (shape)": 2, "autograd None aten::index_put (shape)": 1}


def test_tp2_collectives_check_in_the_first_layer_only(world):
    tp, n = world["tp2"], world["tp2"]["layers"]
    assert _gpu_syncs({"syncs": tp["fresh"]}) == {PACKED_READ: 1, CHECK_UP: 5, CHECK_READ: 5, **EMBEDDING_MASKS}
    # control: every layer checking (the same batch again: no batch read)
    assert _gpu_syncs({"syncs": tp["every_layer_checking"]}) == {CHECK_UP: 4 * n + 1, CHECK_READ: 4 * n + 1,
                                                                  **EMBEDDING_MASKS}


def test_cp2_kv_gather_checks_in_the_first_layer_only(world):
    cp, n = world["cp2"], world["cp2"]["layers"]
    assert _gpu_syncs({"syncs": cp["fresh"]}) == {
        PACKED_READ: 1, CHECK_UP: 1, CHECK_READ: 1, "collectives cp.py:build to(device) (h2d)": 2,
        "collectives cp.py:q_positions cpu (d2h)": 1, "collectives cp.py:q_positions to(device) (h2d)": 1}
    assert _gpu_syncs({"syncs": cp["every_layer_checking"]}) == {CHECK_UP: n, CHECK_READ: n}
