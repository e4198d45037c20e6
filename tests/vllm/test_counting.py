"""Readbacks of P modules (a native run: every rollout letter P) and of compiled code (torch.compile).

All P installs counting only: vLLM's own methods run unchanged (bitwise) and each module gets production
records. Under torch.compile the hooks run only while TorchDynamo traces them: the compiled call sites are
recorded (execution mode ``graph``, ``provenance.counted = "compiled call sites"``), checked here with real
TorchDynamo (``backend="eager"``, ``fullgraph=True``, dynamic shapes) and the validator's readback rules."""

import json
import socket

import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

COUNTING_HOOKS = {"oot.RMSNorm", "oot.SiluAndMul", "oot.UnquantizedFusedMoEMethod", "model_loader", "linear",
                  "lm_head", "cuda_graphs", "sampling_counts"}  # counting only


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _layers(prefix_attn="model.layers.0.self_attn.qkv_proj", prefix_mlp="model.layers.0.mlp.gate_up_proj"):
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm

    norm_a, norm_f, norm_l, act = RMSNorm(64), RMSNorm(64), RMSNorm(64), SiluAndMul()
    for layer, module in ((norm_a, "attention"), (norm_f, "ffn"), (norm_l, "logp"), (act, "ffn")):
        layer._rlk_module = module
        if hasattr(layer, "weight"):
            layer.weight.data = _bf16(64, seed=len(module))
    lins = {}
    for name, prefix, n in (("attn", prefix_attn, 96), ("mlp", prefix_mlp, 128), ("head", "lm_head", 80)):
        lin = torch.nn.Module()
        lin.weight = torch.nn.Parameter(_bf16(n, 64, seed=n), requires_grad=False)
        lin.prefix = prefix
        lin.cpu_linear = lambda x_, w_, b_: torch.nn.functional.linear(x_, w_, b_)  # set by vLLM's CPU processing
        lins[name] = lin
    return norm_a, norm_f, norm_l, act, lins


def _vllm_own(cls, *args):
    """An instance of vLLM's own class, as vLLM builds and dispatches it (``CustomOp.__new__`` would hand
    back the plugin's out-of-tree replacement)."""
    layer = object.__new__(cls)
    cls.__init__(layer, *args)
    assert type(layer) is cls
    return layer


def _vllm_compiles(layer) -> bool:
    """Whether vLLM's ``CustomOp`` dispatch compiled the layer's forward itself (``maybe_compile``: a
    disabled op built with ``compile_native=True`` under a compiling config; 0.33's SiluAndMul on the CPU
    platform, where 0.22's SiluAndMul forces the eager ``forward_native``)."""
    return getattr(layer._forward_method, "_torchdynamo_orig_callable", None) is not None


def _validate_rollout(tmp_path, doc, plan):
    """The validator's rules on this one rollout readback (the train side is absent here)."""
    from rlk_validate.readbacks import check_readbacks
    from rlk_validate.safeio import Root

    (tmp_path / "readbacks").mkdir(exist_ok=True)
    (tmp_path / "readbacks" / f"vllm-rollout-{doc['pid']}.json").write_text(json.dumps(doc))
    findings, summary = check_readbacks(Root(tmp_path), plan)
    return [f["code"] if isinstance(f, dict) else f.code for f in findings], summary


def test_all_p_installs_counting_only_and_vllm_computes_the_same_bits(plugin, vllm_config, tmp_path):
    from vllm.distributed.parallel_state import GroupCoordinator
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.worker.gpu.sample import logprob

    rt = plugin(RL_KERNEL_READBACK_DIR=str(tmp_path / "rb"))
    assert rt is not None and {h[0] for h in rt.hooks} == COUNTING_HOOKS
    (path,) = (tmp_path / "rb" / socket.gethostname()).glob("vllm-rollout-*.json")  # written at registration
    assert {h["name"] for h in json.loads(path.read_text())["hooks"]} == COUNTING_HOOKS
    # nothing that changes arithmetic: no RoPE, attention backend, log-prob hook or TP all-reduce
    assert sorted(op_registry_oot) == ["RMSNorm", "SiluAndMul", "UnquantizedFusedMoEMethod"]
    assert not hasattr(logprob.compute_token_logprobs, "_rlk_original")
    from vllm.v1.worker.gpu.sample.sampler import Sampler  # its requests are counted, its sampling is vLLM's own
    assert hasattr(Sampler.add_request, "_rlk_original")
    assert not hasattr(Sampler.__call__, "_rlk_original")
    assert not hasattr(Sampler.apply_sampling_params, "_rlk_original")
    assert not hasattr(GroupCoordinator._all_reduce_out_place, "_rlk_original")
    with pytest.raises(ValueError, match="must be registered"):
        AttentionBackendEnum.CUSTOM.get_class()
    # the replacements keep vLLM's op names, so custom_ops (+rms_norm, ...) dispatch them as vLLM's own
    for name, base in (("RMSNorm", RMSNorm), ("SiluAndMul", SiluAndMul)):
        assert op_registry_oot[name].name == base.name and op_registry_oot[name].enabled() == base.enabled()

    norm_a, norm_f, norm_l, act, lins = _layers()
    x, res = _bf16(7, 64, seed=1), _bf16(7, 64, seed=2)
    own_norm = _vllm_own(RMSNorm, 64)
    for norm in (norm_a, norm_f, norm_l):
        own_norm.weight.data = norm.weight.data
        got, want = norm(x, res), own_norm(x, res)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    h = _bf16(7, 128, seed=3)
    # vLLM's own layer, as vLLM dispatches it: 0.33 runs SiluAndMul's forward_native compiled (Inductor fuses
    # silu * mul without rounding the silu to bf16, so eager forward_native differs); 0.22 runs it eagerly
    assert torch.equal(act(h), _vllm_own(SiluAndMul)(h))
    for name in ("attn", "mlp"):
        assert torch.equal(UnquantizedLinearMethod().apply(lins[name], x),
                           UnquantizedLinearMethod.apply._rlk_original(UnquantizedLinearMethod(), lins[name], x))
    assert torch.equal(UnquantizedEmbeddingMethod().apply(lins["head"], x),
                       UnquantizedEmbeddingMethod.apply._rlk_original(UnquantizedEmbeddingMethod(), lins["head"], x))

    doc = rt.recorder.to_dict()
    calls = {m: {op: (r["backend_id"], r["call_count"]) for op, r in doc["modules"][m]["ops"].items()}
             for m in doc["modules"]}
    assert calls == {
        # one count per call of a layer (the reference calls of vLLM's methods above count nothing)
        "attention": {"rms_norm": ("production.vllm.RMSNorm", 1),
                      "linear": ("production.vllm.UnquantizedLinearMethod.apply", 1)},
        "ffn": {"rms_norm": ("production.vllm.RMSNorm", 1), "swiglu": ("production.vllm.SiluAndMul", 1),
                "linear": ("production.vllm.UnquantizedLinearMethod.apply", 1)},
        "logp": {"rms_norm": ("production.vllm.RMSNorm", 1),
                 "linear": ("production.vllm.UnquantizedEmbeddingMethod.apply", 1)},
    }, calls
    assert all(r["implementation"] == "production" and r["execution_mode"] == "eager" for r in doc["modules"].values())
    codes, summary = _validate_rollout(tmp_path, doc, {"attention": "P/P", "ffn": "P/P", "logp": "P/P"})
    assert codes == ["READBACKS_MISSING"], codes  # only the train side, absent here
    assert all(summary["sides"]["rollout"]["modules"][m]["call_count"] > 0 for m in ("attention", "ffn", "logp"))


def test_all_p_model_load_binds_every_layer_and_flushes(run_script, tmp_path):
    out = run_script(LOAD_ALL_P, env={"RL_KERNEL_READBACK_DIR": str(tmp_path)})
    assert "bound attention ffn logp" in out, out
    # the recorder files per host and process: vLLM may inspect the model class in a subprocess that loads
    # the plugins too (a miss in its model-info cache, ~/.cache/vllm/modelinfos), so pick this script's own
    pid = int(out.split("pid ", 1)[1].split()[0])
    path = tmp_path / socket.gethostname() / f"vllm-rollout-{pid}.json"
    doc = json.loads(path.read_text())
    assert {h["name"] for h in doc["hooks"]} == COUNTING_HOOKS and doc["plan"] == {
        "attention": "P/P", "ffn": "P/P", "logp": "P/P"}


LOAD_ALL_P = r'''
import os
print("pid", os.getpid())
from vllm.plugins import load_general_plugins
load_general_plugins()
from rlk_vllm_plugin import layers
from vllm_tiny import tiny_model
vc, model = tiny_model()
oot = tuple(layers._CLASSES.values())
bound = {getattr(m, "_rlk_module", None) for m in model.modules() if isinstance(m, oot)}
assert None not in bound, bound
print("bound", *sorted(bound))
print("ok")
'''


def test_compiled_call_sites_are_recorded_at_trace_time_with_the_selected_backend(plugin, vllm_config, tmp_path):
    """Real TorchDynamo over the plugin's hooks (vLLM's compile path itself needs a GPU): each hook records
    the call site it puts into the graph once; running the compiled graph again counts nothing."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from rlk_core.backends import REGISTRY

    rt = plugin(attention="P/P", ffn="R/R", logp="P/P")
    norm_a, norm_f, norm_l, act, lins = _layers()
    lin, head = UnquantizedLinearMethod(), UnquantizedEmbeddingMethod()

    def block(x):
        a = lin.apply(lins["attn"], norm_a(x))  # attention P: vLLM's own
        h = act(lin.apply(lins["mlp"], norm_f(x)))  # ffn R: rlk ops
        return head.apply(lins["head"], norm_l(h + a[:, :64])), norm_f(h)

    torch._dynamo.reset()
    try:
        compiled = torch.compile(block, backend="eager", fullgraph=True, dynamic=True)
        for n in (5, 9, 5):
            x = _bf16(n, 64, seed=n)
            got, want = compiled(x), block(x) if n == 9 else None
            if want is not None:  # the last-but-one eager call also counts, as run-time calls
                assert all(torch.equal(g, w) for g, w in zip(got, want))
    finally:
        torch._dynamo.reset()

    doc = rt.recorder.to_dict()
    ops = {m: doc["modules"][m]["ops"] for m in doc["modules"]}
    rms = ops["ffn"]["rms_norm"]  # two compiled call sites, one eager run of block() made two run-time calls
    assert rms["call_count"] == 4 and rms["execution_mode"] == "mixed"
    assert rms["provenance"] == {"compiled_call_sites": 2, "counted": "run-time calls and compiled call sites"}
    want_backend = REGISTRY.select("swiglu", "cpu", [torch.empty(5, 128, dtype=torch.bfloat16)], True).backend
    # where vLLM compiles the activation itself, the eager run of block() traces the rlk swiglu into vLLM's
    # own graph: a second compiled call site, and no run-time call (vLLM's graph replays without the hook)
    act_sites = 2 if _vllm_compiles(act) else 1
    assert ops["ffn"]["swiglu"]["execution_mode"] == ("graph" if act_sites == 2 else "mixed")
    for op in ("swiglu", "linear"):
        r = ops["ffn"][op]
        assert (r["backend_id"], r["contract_id"]) == ((want_backend.id, REGISTRY.select(
            op, "cpu", [torch.empty(5, 128, dtype=torch.bfloat16)] + ([torch.empty(128, 64, dtype=torch.bfloat16),
                                                                      None] if op == "linear" else []),
            True).backend.contract_id) if op == "linear" else (want_backend.id, want_backend.contract_id))
        sites = act_sites if op == "swiglu" else 1
        assert r["call_count"] == 2 and r["provenance"]["compiled_call_sites"] == sites, (op, r)
    doc_compiled_only = doc["modules"]["attention"]["ops"]
    assert {op: (r["backend_id"], r["call_count"], r["execution_mode"], r["provenance"]["compiled_call_sites"])
            for op, r in doc_compiled_only.items()} == {
        "rms_norm": ("production.vllm.RMSNorm", 2, "mixed", 1),
        "linear": ("production.vllm.UnquantizedLinearMethod.apply", 2, "mixed", 1)}

    # a graph-only readback: what a CUDA-graph run shows for the compiled parts
    from rlk_core.plan import RoutePlan
    from rlk_core.readback import COUNTED_COMPILED, ReadbackRecorder
    from rlk_vllm_plugin import _runtime

    plan = RoutePlan("R/R", "R/R", "R/R")
    rec = ReadbackRecorder("vllm", "rollout", plan, mode="strict")
    rt._recorder, rt._routes = rec, None
    rt.plan = plan
    x = torch.empty(7, 64, dtype=torch.bfloat16)  # what a fake tensor reports: dtype, device, shape
    for module, op, values in (("attention", "rms_norm", [x, torch.empty(64), 1e-6]),
                               ("attention", "linear", [x, torch.empty(96, 64, dtype=torch.bfloat16), None]),
                               ("ffn", "swiglu", [torch.empty(7, 128, dtype=torch.bfloat16)]),
                               ("logp", "rms_norm", [x, torch.empty(64), 1e-6])):
        _runtime.note_compiled_rlk(module, op, values)
    out = rec.to_dict()
    assert all(r["execution_mode"] == "graph" and r["call_count"] > 0 and r["contract_id"]
               and r["backend_id"].startswith("rlk.") for r in out["modules"].values())
    counted = {r["provenance"]["counted"] for m in out["modules"].values() for r in m["ops"].values()}
    assert counted == {COUNTED_COMPILED}
    codes, _ = _validate_rollout(tmp_path, out, plan.as_dict())
    assert codes == ["READBACKS_MISSING"], codes  # only the train side, absent here
