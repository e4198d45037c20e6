"""Plugin loading through vLLM's own loader, VLLM_PLUGINS filtering, idempotence, and each strict refusal."""

import importlib.metadata as md
import socket

import pytest

pytestmark = [
    pytest.mark.vllm,
    # vLLM 0.22 (written for torch 2.11) uses torch.jit.script_method while importing; torch 2.13 deprecates it
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]


def test_entry_point_is_discovered_in_the_general_plugins_group():
    eps = {e.name: e.value for e in md.entry_points(group="vllm.general_plugins")}
    assert eps.get("rlk") == "rlk_vllm_plugin:register"
    # the test-only platform plugin is not part of the production wheel's metadata
    prod = md.distribution("rlk-vllm-plugin").entry_points
    assert {e.group for e in prod} == {"vllm.general_plugins"}


LOAD = r'''
from rlk_vllm_plugin import _runtime
from vllm.plugins import load_general_plugins
load_general_plugins(); load_general_plugins()
rt = _runtime.current()
print("installed", rt is not None and len(rt.hooks))
from vllm.model_executor.custom_op import op_registry_oot
print("oot", sorted(op_registry_oot))
print("ok")
'''


@pytest.mark.parametrize("allow, loaded", [(None, True), ("rlk", True), ("lora_filesystem_resolver", False)])
def test_vllm_loads_the_plugin_unless_vllm_plugins_excludes_it(run_script, allow, loaded):
    env = {"RL_KERNEL_FFN_CASE": "R/R"}
    if allow is not None:
        env["VLLM_PLUGINS"] = allow
    out = run_script(LOAD, env=env)
    if loaded:
        # 8: cuda_graphs and the MoE method besides the six
        assert "installed 10" in out and "oot ['RMSNorm', 'SiluAndMul', 'UnquantizedFusedMoEMethod']" in out, out
    else:
        assert "installed False" in out and "oot []" in out, out


def test_register_is_idempotent_and_refuses_a_changed_plan(plugin, monkeypatch):
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    import rlk_vllm_plugin
    from rlk_core.errors import RlkConfigError

    rt = plugin(ffn="R/R")
    apply = UnquantizedLinearMethod.apply
    rlk_vllm_plugin.register()
    assert UnquantizedLinearMethod.apply is apply and apply._rlk_original is not None
    assert rlk_vllm_plugin._runtime.current() is rt
    monkeypatch.setenv("RL_KERNEL_LOGP_CASE", "R/R")
    with pytest.raises(RlkConfigError, match="installed for plan"):
        rlk_vllm_plugin.register()


@pytest.mark.parametrize("module, target", [
    ("ffn", "vllm.model_executor.layers.activation:SiluAndMul.forward_native"),
    ("attention", "vllm.v1.attention.backends.registry:register_backend"),
    ("logp", "vllm.v1.worker.gpu.sample.logprob:compute_token_logprobs"),
    ("common", "vllm.model_executor.layers.linear:UnquantizedLinearMethod.apply"),
])
def test_strict_refuses_a_vllm_missing_a_hook_target_and_names_it(plugin, monkeypatch, module, target):
    from rlk_core.errors import RlkPolicyError
    from rlk_vllm_plugin import _compat

    mod, _, attr = target.partition(":")
    parts = attr.split(".")
    import importlib
    owner = importlib.import_module(mod)
    for p in parts[:-1]:
        owner = getattr(owner, p)
    monkeypatch.delattr(owner, parts[-1])  # simulate a vLLM that renamed it
    case = {"attention": "P/R", "ffn": "P/R", "logp": "P/R"} if module == "common" else {module: "P/R"}
    with pytest.raises(RlkPolicyError, match=f"lacks: {target.replace('.', '[.]')}"):
        plugin(**case)
    assert _compat  # the refusal happened inside register(): nothing was installed
    from vllm.model_executor.custom_op import op_registry_oot
    assert not op_registry_oot


def _range_after(version: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """A supported range that starts just above the installed vLLM (a vLLM older than the plugin knows)."""
    major, minor = (int(p) for p in version.split(".")[:2])
    return (major, minor + 1), (major, minor + 9)


def test_strict_refuses_an_unsupported_vllm_version(plugin, monkeypatch):
    import re

    import vllm

    from rlk_core.errors import RlkPolicyError
    from rlk_vllm_plugin import _compat

    low, _ = _range_after(vllm.__version__)
    monkeypatch.setattr(_compat, "SUPPORTED", _range_after(vllm.__version__))
    with pytest.raises(RlkPolicyError, match=f"vLLM {re.escape(vllm.__version__)} is outside the supported range "
                                             f"{low[0]}\\.{low[1]} <="):
        plugin(ffn="P/R")


def test_audit_records_the_refusal_as_a_fallback_and_installs_nothing(plugin, monkeypatch):
    import vllm

    from rlk_vllm_plugin import _compat

    monkeypatch.setattr(_compat, "SUPPORTED", _range_after(vllm.__version__))
    rt = plugin(ffn="P/R", mode="audit")
    doc = rt.recorder.to_dict()
    ffn = doc["modules"]["ffn"]
    assert ffn["fallback"] and "outside the supported range" in ffn["fallback_reason"]
    from vllm.model_executor.custom_op import op_registry_oot
    assert not op_registry_oot


def test_readback_lists_the_installed_hooks(plugin, tmp_path):
    import json

    plugin(attention="R/R", ffn="R/R", logp="R/R", RL_KERNEL_READBACK_DIR=str(tmp_path))
    (path,) = (tmp_path / socket.gethostname()).glob("*.json")  # the recorder files per host
    doc = json.loads(path.read_text())
    names = {h["name"] for h in doc["hooks"]}
    assert {"oot.RMSNorm", "oot.SiluAndMul", "oot.RotaryEmbedding", "linear", "lm_head", "logprobs",
            "tp_all_reduce", "attention_backend.CUSTOM", "model_loader"} <= names, names
    assert doc["framework"] == "vllm" and doc["side"] == "rollout"


def test_strict_refuses_a_hook_target_whose_signature_lost_a_parameter(plugin, monkeypatch):
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    from rlk_core.errors import RlkPolicyError

    monkeypatch.setattr(Sampler, "add_request", lambda self, req_idx, params: None)  # a renamed parameter
    with pytest.raises(RlkPolicyError, match=r"lacks: .*Sampler\.add_request \(signature: no parameter "
                                             r"'sampling_params'\)"):
        plugin(logp="P/R")
    from vllm.model_executor.custom_op import op_registry_oot
    assert not op_registry_oot


def test_an_inherited_is_monolithic_is_found_as_vllm_033_has_it(plugin, monkeypatch):
    """vLLM 0.33's ``UnquantizedFusedMoEMethod`` inherits ``is_monolithic`` from ``FusedMoEMethodBase`` (0.22 defines it
    on the class): the plugin overrides it in its subclass either way, so the probe takes the inherited property; a
    vLLM where no class of the MRO defines it is still refused, and names it."""
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    import rlk_vllm_plugin
    from rlk_core.errors import RlkPolicyError
    from rlk_vllm_plugin import _compat

    target = ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:"
              "UnquantizedFusedMoEMethod.is_monolithic")
    if "is_monolithic" in vars(UnquantizedFusedMoEMethod):  # 0.22 defines it on the class: make it 0.33's class
        monkeypatch.delattr(UnquantizedFusedMoEMethod, "is_monolithic")
    assert "is_monolithic" not in vars(UnquantizedFusedMoEMethod)  # the base's property only (0.33 as installed)
    assert _compat._resolve(target) is vars(FusedMoEMethodBase)["is_monolithic"]
    rt = plugin(ffn="R/R")
    assert rt is not None and not _compat.probe(("count",)).missing
    from vllm.model_executor.custom_op import op_registry_oot
    assert "UnquantizedFusedMoEMethod" in op_registry_oot
    rlk_vllm_plugin.uninstall()
    monkeypatch.delattr(FusedMoEMethodBase, "is_monolithic")  # no class defines it: refused, by name
    with pytest.raises(RlkPolicyError, match=r"lacks: .*UnquantizedFusedMoEMethod\.is_monolithic \(AttributeError: "
                                             r"neither UnquantizedFusedMoEMethod nor its bases"):
        plugin(ffn="R/R")
