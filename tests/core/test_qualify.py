"""Qualification of third-party backends for the attention family and the log-prob ops: a backend that
keeps the contract is accepted, one that breaks it (or claims only part of a family) is refused."""

from __future__ import annotations

import pytest
import torch

import rlk_core.ops.attention
import rlk_core.ops.linear_logprobs
import rlk_core.ops.token_logprobs  # noqa: F401
from rlk_core.backends import REGISTRY, Backend
from rlk_core.testing.qualify import ATTENTION_FORWARD


@pytest.fixture
def registry():
    before = {op: dict(REGISTRY._backends[op]) for op in REGISTRY._backends}
    yield REGISTRY
    for op, backends in before.items():
        REGISTRY._backends[op] = backends
    REGISTRY._qualified.clear()
    REGISTRY._available.clear()


def ref(op):
    return REGISTRY.get(op, "rlk.reference").fn


def add(registry, op, fn, backend_id="acme.kernels"):
    return registry.register(Backend(backend_id, op, fn, devices=("cpu",), priority=50, origin="acme"))


def test_an_attention_family_that_keeps_the_contract_qualifies(registry):
    for op in ATTENTION_FORWARD:
        add(registry, op, ref(op))
    ok, why = registry.qualify(registry.get("attention_decode", "acme.kernels"), "cpu")
    assert ok, why
    assert "prefill == chunked" in why


def test_half_a_family_is_refused(registry):
    add(registry, "attention_decode", ref("attention_decode"))
    ok, why = registry.qualify(registry.get("attention_decode", "acme.kernels"), "cpu")
    assert not ok and "must come from one backend" in why and "attention_varlen" in why


def test_a_decode_that_differs_from_prefill_is_refused(registry):
    def other_decode(q, k_cache, v_cache, block_table, seq_lens, scale):  # one ulp-scale change in fp32
        out = ref("attention_decode")(q, k_cache, v_cache, block_table, seq_lens, scale)
        return (out.double() * (1 + 2**-20)).to(out.dtype)

    for op in ATTENTION_FORWARD:
        add(registry, op, other_decode if op == "attention_decode" else ref(op))
    ok, why = registry.qualify(registry.get("attention_varlen", "acme.kernels"), "cpu")
    assert not ok and "decode" in why


def test_kv_cache_write_must_be_exact(registry):
    add(registry, "kv_cache_write", ref("kv_cache_write"))
    ok, why = registry.qualify(registry.get("kv_cache_write", "acme.kernels"), "cpu")
    assert ok, why

    def writes_padding_too(k, v, k_cache, v_cache, slots):
        ref("kv_cache_write")(k, v, k_cache, v_cache, torch.where(slots < 0, torch.zeros_like(slots), slots))

    add(registry, "kv_cache_write", writes_padding_too, "acme.sloppy")
    ok, why = registry.qualify(registry.get("kv_cache_write", "acme.sloppy"), "cpu")
    assert not ok and "exact write" in why


def test_attention_backward_must_be_deterministic(registry):
    add(registry, "attention_varlen_backward", ref("attention_varlen_backward"))
    ok, why = registry.qualify(registry.get("attention_varlen_backward", "acme.kernels"), "cpu")
    assert ok, why
    calls = []

    def drifting(*args):  # a different result on every call, as atomics would give
        calls.append(1)
        dq, dk, dv = ref("attention_varlen_backward")(*args)
        return dq + len(calls) * 1e-3, dk, dv

    add(registry, "attention_varlen_backward", drifting, "acme.atomic")
    ok, why = registry.qualify(registry.get("attention_varlen_backward", "acme.atomic"), "cpu")
    assert not ok and "run-to-run" in why


def test_token_logprobs_qualification(registry):
    add(registry, "token_logprobs", ref("token_logprobs"))
    ok, why = registry.qualify(registry.get("token_logprobs", "acme.kernels"), "cpu")
    assert ok, why

    def batch_dependent(shards, target, temp):  # breaks batch invariance on purpose
        logp, lse = ref("token_logprobs")(shards, target, temp)
        return logp + 1e-3 * target.shape[0], lse

    add(registry, "token_logprobs", batch_dependent, "acme.bad")
    ok, why = registry.qualify(registry.get("token_logprobs", "acme.bad"), "cpu")
    assert not ok and "row alone" in why


def test_linear_logprobs_needs_the_same_backends_linear_and_token_logprobs(registry):
    add(registry, "linear_logprobs", ref("linear_logprobs"))
    ok, why = registry.qualify(registry.get("linear_logprobs", "acme.kernels"), "cpu")
    assert not ok and "must come from one backend" in why
    add(registry, "linear", ref("linear"))
    add(registry, "token_logprobs", ref("token_logprobs"))
    registry._qualified.clear()
    ok, why = registry.qualify(registry.get("linear_logprobs", "acme.kernels"), "cpu")
    assert ok, why and "fused == unfused" in why
