"""Sweeps of calls for the attention and log-prob ops, shared by the CPU tests (every launch ``rlk.triton`` makes
for them finds its AOT variant, or ``rlk.cuda`` declines the call with a reason; ``rlk.cuda``'s launches are
``rlk.triton``'s) and the GPU tests (``rlk.cuda`` ``torch.equal`` to ``rlk.triton`` on every served variant).

Each case is ``(op, args, served)``: ``served`` says whether ``rlk.cuda`` must take the call (a shape that
matters, aligned, its variant built) or must decline it (a head size, group, vocabulary or layout not built).
The served cases reach every variant the AOT enumeration builds for these ops (checked on the CPU).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from rlk_core.ops.attention.triton import HEAD_DIMS
from rlk_core.ops.attention.triton_backward import GROUPS as BACKWARD_GROUPS

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (Hq, Hkv): every padded GQA group 1..128 of the forward rule (G = 3, 5, 9, ... round up), MHA and GQA
HEADS = ((1, 1), (2, 1), (3, 1), (5, 1), (12, 1), (32, 8), (17, 1), (40, 1), (65, 1), (28, 4))
Case = tuple[str, tuple, bool]


def _rand(shape, dtype, device, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def _gen(device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    return buf[1:].view(t.shape).copy_(t)


def _forward_ok(dtype: torch.dtype, d: int, hq: int, hkv: int) -> bool:
    """Whether rlk.triton's own rule takes the heads (its configs and GQA bound) at a built head size."""
    from rlk_core.ops.attention import triton as tr

    q, k = (torch.empty((1, h, d), dtype=dtype, device="meta") for h in (hq, hkv))
    return d in HEAD_DIMS and tr._supports_heads(q, k)[0]


def rowwise_and_linear_cases(device, dtypes=DTYPES) -> Iterator[Case]:
    """The forward ops the sweeps of ``_cuda_cases`` leave out: linear at every M the tile rule treats apart and the
    model shapes, rms_norm, swiglu, rope (every built pair, head classes, positions int32 / int64); then the
    declined (misaligned operands, sizes not multiples of 16, a rope pair not built)."""
    gen = _gen(device, 22)

    def rnd(*shape, dtype=torch.bfloat16):
        return _rand(shape, dtype, device, gen)

    for dtype in dtypes:
        for m in (1, 5, 16, 17, 64, 65, 80, 96, 128, 129, 300, 1000, 4096):
            for n, k in ((1024, 1024), (3072, 1024), (1536, 4096), (4096, 1536)):
                x, w = rnd(m, k, dtype=dtype), rnd(n, k, dtype=dtype)
                yield "linear", (x, w, None), True
            yield "linear", (rnd(2, m, 1024, dtype=dtype), rnd(1536, 1024, dtype=dtype), rnd(1536, dtype=dtype)), True
        yield "linear", (_misaligned(rnd(5, 1536, dtype=dtype)), w, None), False
        yield "linear", (rnd(5, 1000, dtype=dtype), rnd(48, 1000, dtype=dtype), None), False
        for h in (16, 128, 1024, 4096, 65536):
            for wd in sorted({dtype, torch.float32}, key=str):
                yield "rms_norm", (rnd(7, h, dtype=dtype), rnd(h, dtype=wd), 1e-6), True
        qkv = rnd(5, 16 + 2 * 8, 128, dtype=dtype)
        yield "rms_norm", (qkv[:, :16], rnd(128, dtype=dtype), 1e-6), True  # a head view: copied, from Python
        yield "rms_norm", (rnd(3, 100, dtype=dtype), rnd(100, dtype=dtype), 1e-6), False
        for inter in (16, 256, 1536, 3072):
            yield "swiglu", (rnd(3, 2 * inter, dtype=dtype),), True
            yield "swiglu", (_misaligned(rnd(3, 2 * inter, dtype=dtype)),), True  # the variant with no alignment
        for d, r in ((128, 128), (128, 64), (64, 64)):
            for nh in (1, 7, 8, 16, 32):
                for pt in (torch.int32, torch.int64):
                    yield "rope", (rnd(4, nh, d, dtype=dtype), torch.arange(4, dtype=pt, device=device), 1e6, r), True
        yield "rope", (rnd(4, 8, 96, dtype=dtype), torch.arange(4, device=device), 1e6, 96), False


def attention_forward_cases(device, dtypes=DTYPES, page_sizes=(16,), contexts=((5, 130, 64),)) -> Iterator[Case]:
    """varlen (contiguous K/V: the TMA path at d = 128; K/V as halves of one ``[T, Hkv, 2d]`` buffer: pointer
    loads), chunked prefill and decode over a vLLM-style paged cache (``[blocks, page, Hkv, 2d]``, K and V its
    halves) for every dtype, built head size and head pair; then the declined: head size 80, a misaligned ``q``,
    a GQA group past the decode tile."""
    gen = _gen(device, 11)
    for dtype in dtypes:
        for d in HEAD_DIMS:
            if dtype == torch.float32 and d == 256:
                continue
            for hq, hkv in HEADS:
                ok = _forward_ok(dtype, d, hq, hkv)
                yield from _forward_calls(device, gen, dtype, d, hq, hkv, page_sizes, contexts if ok else contexts[:1],
                                          ok)
    for dtype, d, hq, hkv in ((torch.bfloat16, 80, 8, 2), (torch.float16, 128, 128, 1)):
        yield from _forward_calls(device, gen, dtype, d, hq, hkv, (16,), contexts[:1], False)
    q = _rand((7, 8, 128), torch.bfloat16, device, gen)
    k, v = _rand((7, 2, 128), torch.bfloat16, device, gen), _rand((7, 2, 128), torch.bfloat16, device, gen)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device=device)
    yield "attention_varlen", (_misaligned(q), k, v, cu, cu, 0.1, True, None), False


def _forward_calls(device, gen, dtype, d, hq, hkv, page_sizes, contexts, served) -> Iterator[Case]:
    scale = d ** -0.5
    for lens in contexts:
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        t = int(cu[-1])
        q = _rand((t, hq, d), dtype, device, gen)
        k, v = _rand((t, hkv, d), dtype, device, gen), _rand((t, hkv, d), dtype, device, gen)
        yield "attention_varlen", (q, k, v, cu, cu, scale, True, None), served
        kv = _rand((t, hkv, 2 * d), dtype, device, gen)  # K/V halves of one buffer: no TMA descriptor
        yield "attention_varlen", (q, kv[..., :d], kv[..., d:], cu, cu, scale, False, None), served
        pos = torch.cat([torch.randperm(n, generator=torch.Generator().manual_seed(n)) for n in lens]).to(device)
        yield "attention_varlen", (q, k, v, cu, cu, scale, True, pos), served  # int64: converted per call
        yield "attention_varlen", (q, k, v, cu, cu, scale, True, pos.int()), served
        for page in page_sizes:
            pages = -(-max(lens) // page) + 1
            blocks = len(lens) * pages + 3
            cache = _rand((blocks, page, hkv, 2 * d), dtype, device, gen)
            kc, vc = cache[..., :d], cache[..., d:]
            perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(page), dtype=torch.int32)
            table = perm[: len(lens) * pages].view(len(lens), pages).to(device)
            seq = torch.tensor(lens, dtype=torch.int32, device=device)
            chunk = [max(1, n // 3) for n in lens]
            cq = torch.tensor([0, *torch.tensor(chunk).cumsum(0).tolist()], dtype=torch.int32, device=device)
            qc = _rand((int(cq[-1]), hq, d), dtype, device, gen)
            yield "attention_paged_prefill", (qc, kc, vc, table, cq, seq, scale), served
            qkv = _rand((len(lens), hq + 2 * hkv, d), dtype, device, gen)  # q as vLLM's view of the QKV output
            yield "attention_decode", (qkv[:, :hq], kc, vc, table, seq, scale), served


def kv_cache_write_cases(device, dtypes=DTYPES) -> Iterator[Case]:
    """Every head-count and page-size class the launcher can specialise (1 / below 16 / a multiple of 16), K and V
    as views of a QKV output, into the halves of a vLLM-style cache; slots with -1 (skipped); then the declined:
    a head size not built, more heads than built, a misaligned ``k``."""
    gen = _gen(device, 12)
    for dtype in dtypes:
        for d in HEAD_DIMS:
            for h in (1, 2, 3, 5, 9, 16, 17, 32, 33, 64, 65, 128):
                for page in (1, 4, 16):
                    yield "kv_cache_write", _kv_args(device, gen, dtype, d, h, page, 6), True
    yield "kv_cache_write", _kv_args(device, gen, torch.bfloat16, 96, 8, 16, 6), False
    yield "kv_cache_write", _kv_args(device, gen, torch.bfloat16, 64, 129, 16, 3), False
    k, v, kc, vc, slots = _kv_args(device, gen, torch.bfloat16, 128, 8, 16, 5)
    yield "kv_cache_write", (_misaligned(k), v, kc, vc, slots), False


def _kv_args(device, gen, dtype, d, h, page, t) -> tuple:
    qkv = _rand((t, (2 + 2) * h, d), dtype, device, gen)
    blocks = max(4, t)  # a slot for every token at every page size (a shorter slot_mapping reads past its end)
    cache = _rand((blocks, page, h, 2 * d), dtype, device, gen)
    slots = torch.randperm(blocks * page, generator=torch.Generator().manual_seed(t + h))[:t].to(device)
    slots[t // 2] = -1
    return qkv[:, 2 * h:3 * h], qkv[:, 3 * h:], cache[..., :d], cache[..., d:], slots


def attention_backward_cases(device, dtypes=DTYPES) -> Iterator[Case]:
    """Every built GQA group, head size and masking mode (aligned causal, non-causal, positions int32 / int64)
    of the backward; then the declined: a group not built (3), head size 256 (rlk.triton's rule), 80."""
    gen = _gen(device, 13)
    for dtype in dtypes:
        for d in (64, 128):
            for g in BACKWARD_GROUPS:
                hkv = 1 if g > 4 else 2
                for mode in ("aligned", "full", "pos32", "pos64"):
                    yield "attention_varlen_backward", _bwd_args(device, gen, dtype, d, g * hkv, hkv, mode), True
    for d, hq, hkv in ((128, 3, 1), (256, 4, 1), (80, 4, 2)):
        yield "attention_varlen_backward", _bwd_args(device, gen, torch.bfloat16, d, hq, hkv, "aligned"), False


def _bwd_args(device, gen, dtype, d, hq, hkv, mode) -> tuple:
    lens = (5, 70, 33)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    t = int(cu[-1])
    q, k, v, g = (_rand((t, h, d), dtype, device, gen) for h in (hq, hkv, hkv, hq))
    pos = None
    if mode.startswith("pos"):
        pos = torch.cat([torch.randperm(n, generator=torch.Generator().manual_seed(n)) for n in lens]).to(device)
        pos = pos.to(torch.int32 if mode == "pos32" else torch.int64)
    return g, q, k, v, cu, cu, d ** -0.5, mode != "full", pos


VOCABS = (151936, 128256, 32000)


def logprob_cases(device, dtypes=DTYPES, rows=(5, 17)) -> Iterator[Case]:
    """``token_logprobs`` and its backward over vocabularies that are multiples of 128 split in 1, 2, 4, 8
    shards; ``logp_partials`` on shards of 1..8 groups for every padded block count ``P`` (up to 4096),
    ``merge_logp_partials`` for every group count; then the declined: a vocabulary that is not a multiple of 128
    (50257), a column-sliced logits view."""
    gen = _gen(device, 14)
    for dtype in dtypes:
        for t in rows:
            for vocab in VOCABS:
                x = _rand((t, vocab), dtype, device, gen)
                target = torch.randint(0, vocab, (t,), generator=torch.Generator().manual_seed(t)).to(device)
                temp = (torch.rand(t, generator=torch.Generator().manual_seed(vocab)) + 0.5).to(device)
                for tp in (1, 2, 4, 8):
                    shards = list(x.split(vocab // tp, dim=1)) if tp > 1 else [x]
                    tgt = target.int() if tp == 2 else target  # int32 and int64 target ids
                    yield "token_logprobs", (shards, tgt, temp), True
                    lse, gl, gs = (_rand((t,), torch.float32, device, gen) for _ in range(3))
                    yield "token_logprobs_backward", (shards, tgt, temp, lse, gl, gs), True
    x = _rand((3, 50257), torch.bfloat16, device, gen)
    tgt = torch.tensor([0, 7, 50256], device=device)
    one = torch.ones(3, device=device)
    yield "token_logprobs", ([x], tgt, one), False
    wide = _rand((3, 32000 + 64), torch.bfloat16, device, gen)
    yield "token_logprobs", ([wide[:, 1:32001]], tgt, one), False  # rows at a 2-byte offset
    # logp_partials: P = padded blocks per group, shards of g groups (the merge's every stride class), logits of the
    # first dtype asked for (the merges are fp32 whatever the logits: a build of that dtype alone serves these)
    p, first = 1, tuple(dtypes)[0]
    while p <= 4096:
        vocab = 8 * 256 * p
        for g in (1, 2, 3, 8) if p in (1, 16, 4096) else (1, 8):
            x = torch.empty((2, g * 256 * p), dtype=first, device=device).normal_(generator=gen)
            tgt = torch.tensor([0, g * 256 * p - 1], device=device)
            yield "logp_partials", (x, tgt, torch.ones(2, device=device), 0, vocab), (g * p) % 16 == 0 and p % 4 == 0
        p *= 2
    for k in range(1, 9):  # merge of k group partials: V = k gives k groups of one column
        m, s = _rand((4, k), torch.float32, device, gen), _rand((4, k), torch.float32, device, gen).abs()
        yield "merge_logp_partials", (m, s, _rand((4,), torch.float32, device, gen), k), True


LINEAR_ROWS = 6


def linear_chunk_bytes() -> int:
    """A ``linear_logprobs.triton.CHUNK_BYTES`` that makes every chunk one leaf block at :data:`LINEAR_ROWS` rows
    (the chunk rule's answer for ~2**19 rows at the shipped size): chunks start at every slot, so a chunk's first
    slot takes each of its classes (0, 1, neither multiple of 16 nor 1)."""
    return LINEAR_ROWS * 2 * 256


def linear_logprob_cases(device, dtypes=DTYPES) -> Iterator[Case]:
    """``linear_logprobs`` (and ``linear_logp_partials``) over a vocabulary of 8 groups of 4 leaf blocks, in 1 or 2
    weight shards (the caller sets :func:`linear_chunk_bytes`: chunks start at slots 0, 1, 2, 3). The backward:
    :func:`linear_logprobs_backward_cases`."""
    gen = _gen(device, 15)
    vocab, hidden = 8 * 4 * 256, 64
    for dtype in dtypes:
        t = LINEAR_ROWS
        h = _rand((t, hidden), dtype, device, gen)
        w = _rand((vocab, hidden), dtype, device, gen) / 8
        target = torch.randint(0, vocab, (t,), generator=torch.Generator().manual_seed(t)).to(device)
        temp = torch.full((t,), 0.9, device=device)
        keep_value = torch.full((t,), float("-inf"), device=device)  # a kept set of the whole vocabulary
        keep_id = torch.full((t,), vocab - 1, dtype=torch.int64, device=device)
        for tp in (1, 2):
            ws = list(w.split(vocab // tp)) if tp > 1 else [w]
            yield "linear_logprobs", (h, ws, target.int() if tp == 2 else target, temp), True
            # the processed form (contract rlk.logp.processed.v1): the FILTER variants of the same leaf-slot classes
            yield "processed_linear_logprobs", (h, ws, target, temp, keep_value, keep_id), True
        yield "linear_logp_partials", (h, w[: vocab // 2], target, temp, 0, vocab), True


def linear_logprobs_backward_cases(device, dtypes=DTYPES) -> Iterator[Case]:
    """``linear_logprobs_backward`` (per chunk: the gradient kernel over the recomputed logits, then the dhidden and
    dW products on the stored-layout GEMMs) on 1 or 2 weight shards of the same vocabulary, :data:`LINEAR_ROWS`
    tokens and 17 (neither a multiple of 16: the token count is never specialised); then the declined: no tokens
    (rlk.triton launches nothing), a hidden size that is not a multiple of 16 (the GEMMs' other variant)."""
    gen = _gen(device, 21)
    vocab = 8 * 4 * 256
    for dtype in dtypes:
        for t, hidden in ((LINEAR_ROWS, 64), (17, 128)):
            h = _rand((t, hidden), dtype, device, gen)
            w = _rand((vocab, hidden), dtype, device, gen) / 8
            target = torch.randint(0, vocab, (t,), generator=torch.Generator().manual_seed(t)).to(device)
            temp = torch.full((t,), 0.9, device=device)
            lse, g_logp, g_lse = (_rand((t,), torch.float32, device, gen) for _ in range(3))
            for tp in (1, 2):
                ws = list(w.split(vocab // tp)) if tp > 1 else [w]
                yield "linear_logprobs_backward", (h, ws, target, temp, lse + 9, g_logp, g_lse), True
    dtype = dtypes[0]
    for t, hidden in ((0, 64), (LINEAR_ROWS, 40)):
        h = _rand((t, hidden), dtype, device, gen)
        w = _rand((vocab, hidden), dtype, device, gen)
        z = torch.zeros(t, device=device)
        ids = torch.zeros(t, dtype=torch.long, device=device)
        yield "linear_logprobs_backward", (h, [w], ids, z + 1, z, z, z), False


def all_cases(device) -> Iterator[Case]:
    yield from attention_forward_cases(device)
    yield from kv_cache_write_cases(device)
    yield from attention_backward_cases(device)
    yield from logprob_cases(device)


def describe(args: Any) -> str:
    def one(a):
        if isinstance(a, torch.Tensor):
            return f"{tuple(a.shape)}{str(a.dtype)[6:]}"
        if isinstance(a, list):
            return "[" + ",".join(one(x) for x in a) + "]"
        return repr(a)
    return ", ".join(one(a) for a in args)


# -- the backward kernels of the row-wise ops and linear's stored-layout GEMMs ------------------------------------
RMS_HS = (16, 32, 48, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)  # every config with BLOCK_H >= 16


def rms_norm_backward_cases(device, dtypes=DTYPES) -> Iterator[Case]:
    """``rms_norm_backward`` at every row-length config a multiple of 16 reaches, the weight in the input dtype or
    fp32: rows of a 2-D input, a ``[T, heads, D]`` head view of a QKV output (the q/k norm); then the declined: a row
    length that is not a multiple of 16, a misaligned input, a gradient of another dtype."""
    gen = _gen(device, 16)
    for dtype in dtypes:
        for wdtype in sorted({dtype, torch.float32}, key=str):
            for h in RMS_HS:
                w = _rand((h,), wdtype, device, gen)
                rows = 3 if h > 4096 else 37
                x, g = _rand((rows, h), dtype, device, gen), _rand((rows, h), dtype, device, gen)
                yield "rms_norm_backward", (g, x, w, 1e-6), True
                if h <= 256:
                    qkv = _rand((5, 4 + 2, h), dtype, device, gen)
                    yield "rms_norm_backward", (_rand((5, 4, h), dtype, device, gen), qkv[:, :4], w, 1e-5), True
    w = torch.ones(100, device=device)
    yield "rms_norm_backward", (_rand((3, 100), torch.bfloat16, device, gen), _rand((3, 100), torch.bfloat16, device,
                                                                                      gen), w, 1e-6), False
    x = _rand((3, 64), torch.bfloat16, device, gen)
    w = torch.ones(64, device=device)
    yield "rms_norm_backward", (x, _misaligned(x), w, 1e-6), False
    yield "rms_norm_backward", (x.float(), x, w, 1e-6), False


SWIGLU_IS = (16, 32, 64, 128, 256, 512, 1024, 2048, 3072)  # every BLOCK from 16 to 2048, and I past it


def swiglu_backward_cases(device, dtypes=DTYPES) -> Iterator[Case]:
    """``swiglu_backward`` at every block config an intermediate size a multiple of 16 reaches, on a 2-D and a 3-D
    input and on the gate/up half of a wider buffer; then the declined: I not a multiple of 16, a misaligned input."""
    gen = _gen(device, 17)
    for dtype in dtypes:
        for inter in SWIGLU_IS:
            x, g = _rand((7, 2 * inter), dtype, device, gen), _rand((7, inter), dtype, device, gen)
            yield "swiglu_backward", (g, x), True
            wide = _rand((2, 3, 4 * inter), dtype, device, gen)
            yield "swiglu_backward", (_rand((2, 3, inter), dtype, device, gen), wide[..., : 2 * inter]), True
    x = _rand((3, 200), torch.bfloat16, device, gen)
    yield "swiglu_backward", (_rand((3, 100), torch.bfloat16, device, gen), x), False
    x = _rand((3, 64), torch.bfloat16, device, gen)
    yield "swiglu_backward", (_rand((3, 32), torch.bfloat16, device, gen), _misaligned(x)), False


def rope_heads(half: int) -> list[int]:
    """Head counts reaching every ``(config, class)`` of ``rope.triton.config(heads, half)``: 1, 2, and for each power
    of two ``p`` up to the first past the config's cap both ``p`` and ``p - 1``."""
    from rlk_core.ops.rope import triton as rp

    cap = rp.config(1 << 20, half)["BLOCK_H"]
    out, p = [1, 2], 4
    while p <= 2 * max(cap, 16):
        out += [p - 1, p]
        p *= 2
    return out


def rope_backward_cases(device, dtypes=DTYPES) -> Iterator[Case]:
    """``rope_backward`` for every built ``(head_dim, rotary_dim)``, every head-count class, positions int32 and
    int64, the gradient contiguous or a head view of a wider one; then the declined: a pair not built (96, 96), a
    misaligned gradient, a position slice at a 4-byte offset."""
    from rlk_core.ops.rope.triton import SHAPES as ROPE_SHAPES

    gen = _gen(device, 18)
    t = 3
    for dtype in dtypes:
        for d, r in ROPE_SHAPES:
            for nh in rope_heads(r // 2):
                for pdt in (torch.int32, torch.int64):
                    pos = torch.randperm(50, generator=torch.Generator().manual_seed(nh))[:t].to(device, pdt)
                    yield "rope_backward", (_rand((t, nh, d), dtype, device, gen), pos, 1e6, r), True
                if nh <= 8:
                    wide = _rand((t, nh + 2, d), dtype, device, gen)
                    yield "rope_backward", (wide[:, :nh], pos, 1e4, r), True
    pos = torch.arange(8, device=device, dtype=torch.int32)
    yield "rope_backward", (_rand((4, 8, 96), torch.bfloat16, device, gen), pos[:4], 1e6, 96), False
    g = _rand((4, 8, 128), torch.bfloat16, device, gen)
    yield "rope_backward", (_misaligned(g), pos[:4], 1e6, 128), False
    yield "rope_backward", (g, pos[1:5], 1e6, 128), False


# (N_out, K_in) of the linear backward's GEMMs: every tile of the stored rule for dx (N = K_in) and dW (M = N_out,
# N = K_in) — 128x64 / 128x128 / 128x256 — a 16-column output (the narrow tile), N_out not a multiple of 16 (dW stays
# served: its operands reach the TMA kernel by descriptors)
LINEAR_BWD_SHAPES = ((1024, 48), (1024, 1152), (4096, 4096), (6144, 1024), (128, 128), (64, 16), (1000, 64))


def linear_backward_calls(device, gen, dtype, t: int, n_out: int, k_in: int) -> Iterator[tuple[str, tuple]]:
    """The three GEMMs ``ops/linear/__init__.py::_backward`` makes through ``linear`` for ``x [t, k_in]``,
    ``W [n_out, k_in]`` with a bias: ``(name, (x, weight, None))``."""
    x = _rand((t, k_in), dtype, device, gen)
    w = _rand((n_out, k_in), dtype, device, gen)
    g = _rand((t, n_out), dtype, device, gen)
    yield "dx", (g, w.t(), None)
    yield "dw", (g.t(), x.t(), None)
    yield "db", (g.t(), g.new_ones(1).as_strided((1, t), (1, 0)), None)


def linear_backward_cases(device, dtypes=DTYPES) -> Iterator[Case]:
    """``linear`` on the backward's stored-layout views for every shape of :data:`LINEAR_BWD_SHAPES` and one token
    or five (declined where N_out = 1000 is a stride of the pointer kernel: db, fp32); then the declined: an output
    of columns not a multiple of 16 (dx and dW at K_in = 1000), a misaligned gradient, a transposed x against a
    weight as stored (not the backward's)."""
    gen = _gen(device, 19)
    for dtype in dtypes:
        for n_out, k_in in LINEAR_BWD_SHAPES:
            for t in (5, 1):
                for name, args in linear_backward_calls(device, gen, dtype, t, n_out, k_in):
                    # N_out enters the pointer kernel's strides (db's, and every fp32 GEMM's), not the TMA kernel's
                    yield "linear", args, not (n_out % 16 and (name == "db" or dtype == torch.float32))
    for name, args in linear_backward_calls(device, gen, torch.bfloat16, 5, 64, 1000):
        yield "linear", args, name == "db" and torch.bfloat16 in dtypes  # (db: served where bf16 is built)
    g = _rand((5, 64), torch.bfloat16, device, gen)
    w = _rand((64, 128), torch.bfloat16, device, gen)
    yield "linear", (_misaligned(g), w.t(), None), False
    yield "linear", (g.t(), _rand((32, 5), torch.bfloat16, device, gen), None), False


def backward_cases(device) -> Iterator[Case]:
    yield from rms_norm_backward_cases(device)
    yield from swiglu_backward_cases(device)
    yield from rope_backward_cases(device)
    yield from linear_backward_cases(device)
