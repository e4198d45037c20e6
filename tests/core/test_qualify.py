"""Qualification of third-party backends for the attention family and the log-prob ops: a backend that
keeps the contract is accepted, one that breaks it (or claims only part of a family) is refused."""

from __future__ import annotations

import torch

import rlk_core.ops.attention
import rlk_core.ops.linear_logprobs
import rlk_core.ops.token_logprobs  # noqa: F401
from rlk_core.backends import REGISTRY, Backend
from rlk_core.testing.qualify import ATTENTION_FORWARD


def ref(op):
    return REGISTRY.get(op, "rlk.reference").fn


def qualify(registry, op, backend_id):
    return registry.qualify(registry.get(op, backend_id), "cpu")


def add(clean_registry, op, fn, backend_id="acme.kernels"):
    return clean_registry.register(Backend(backend_id, op, fn, devices=("cpu",), priority=50, origin="acme"))


def test_an_attention_family_that_keeps_the_contract_qualifies(clean_registry):
    for op in ATTENTION_FORWARD:
        add(clean_registry, op, ref(op))
    ok, why = qualify(clean_registry, "attention_decode", "acme.kernels")
    assert ok, why
    assert "prefill_chunked_decode" in why and "batch_composition" in why


def test_half_a_family_is_refused(clean_registry):
    add(clean_registry, "attention_decode", ref("attention_decode"))
    ok, why = qualify(clean_registry, "attention_decode", "acme.kernels")
    assert not ok and "must come from one backend" in why and "attention_varlen" in why


def test_a_decode_that_differs_from_prefill_is_refused(clean_registry):
    def other_decode(q, k_cache, v_cache, block_table, seq_lens, scale):  # one ulp-scale change in fp32
        out = ref("attention_decode")(q, k_cache, v_cache, block_table, seq_lens, scale)
        return (out.double() * (1 + 2**-20)).to(out.dtype)

    for op in ATTENTION_FORWARD:
        add(clean_registry, op, other_decode if op == "attention_decode" else ref(op))
    ok, why = qualify(clean_registry, "attention_varlen", "acme.kernels")
    assert not ok and why.startswith("prefill_chunked_decode:") and "decode" in why


def test_kv_cache_write_must_be_exact(clean_registry):
    add(clean_registry, "kv_cache_write", ref("kv_cache_write"))
    ok, why = qualify(clean_registry, "kv_cache_write", "acme.kernels")
    assert ok, why

    def writes_padding_too(k, v, k_cache, v_cache, slots):
        ref("kv_cache_write")(k, v, k_cache, v_cache, torch.where(slots < 0, torch.zeros_like(slots), slots))

    add(clean_registry, "kv_cache_write", writes_padding_too, "acme.sloppy")
    ok, why = qualify(clean_registry, "kv_cache_write", "acme.sloppy")
    assert not ok and "exact write" in why


def test_attention_backward_must_be_deterministic(clean_registry):
    add(clean_registry, "attention_varlen_backward", ref("attention_varlen_backward"))
    ok, why = qualify(clean_registry, "attention_varlen_backward", "acme.kernels")
    assert ok, why
    calls = []

    def drifting(*args):  # a different result on every call, as atomics would give
        calls.append(1)
        dq, dk, dv = ref("attention_varlen_backward")(*args)
        return dq + len(calls) * 1e-3, dk, dv

    add(clean_registry, "attention_varlen_backward", drifting, "acme.atomic")
    ok, why = qualify(clean_registry, "attention_varlen_backward", "acme.atomic")
    assert not ok and why.startswith("run_to_run:"), why


def test_token_logprobs_qualification(clean_registry):
    add(clean_registry, "token_logprobs", ref("token_logprobs"))
    ok, why = qualify(clean_registry, "token_logprobs", "acme.kernels")
    assert ok, why

    def batch_dependent(shards, target, temp):  # breaks batch invariance on purpose
        logp, lse = ref("token_logprobs")(shards, target, temp)
        return logp + 1e-3 * target.shape[0], lse

    add(clean_registry, "token_logprobs", batch_dependent, "acme.bad")
    ok, why = qualify(clean_registry, "token_logprobs", "acme.bad")
    assert not ok and "row alone" in why


def test_linear_logprobs_needs_the_same_backends_linear_and_token_logprobs(clean_registry):
    add(clean_registry, "linear_logprobs", ref("linear_logprobs"))
    ok, why = qualify(clean_registry, "linear_logprobs", "acme.kernels")
    assert not ok and "must come from one backend" in why
    add(clean_registry, "linear", ref("linear"))
    add(clean_registry, "token_logprobs", ref("token_logprobs"))
    clean_registry._qualified.clear()
    ok, why = qualify(clean_registry, "linear_logprobs", "acme.kernels")
    assert ok, why
    assert "fused_equals_unfused" in why
