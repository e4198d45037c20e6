"""Each package builds into its own wheel with correct metadata and dependencies."""

import os
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "rlk-core": "rlk_core",
    "rlk-collectives": "rlk_collectives",
    "rlk-vllm-plugin": "rlk_vllm_plugin",
    "rlk-megatron-provider": "rlk_megatron_provider",
    "rlk-validate": "rlk_validate",
    "rlk-repro": "rlk_repro",
}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
         *(str(ROOT / "packages" / name) for name in PACKAGES)],
        check=True, capture_output=True, env={**os.environ, "RLK_BUILD_EXT": "0"},
    )
    return {p.name.split("-")[0].replace("_", "-"): p for p in out.glob("*.whl")}


def _metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        eps = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
        names = z.namelist()
        return Parser().parsestr(z.read(meta).decode()), (z.read(eps[0]).decode() if eps else ""), names


@pytest.mark.parametrize("name", list(PACKAGES))
def test_each_package_is_its_own_wheel(wheels, name):
    meta, _, names = _metadata(wheels[name])
    assert meta["Name"] == name and meta["Version"]
    assert any(n.startswith(f"{PACKAGES[name]}/__init__.py") for n in names)
    for other, module in PACKAGES.items():
        if other != name:
            assert not any(n.startswith(f"{module}/") for n in names), f"{name} wheel contains {module}"


def test_dependencies_point_one_way(wheels):
    def requires(name):
        meta, _, _ = _metadata(wheels[name])
        return [r.split(";")[0].strip() for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]

    validate = requires("rlk-validate")
    assert not any(r.startswith(("torch", "rlk-")) for r in validate), validate
    # rlk-core writes its evidence through rlk-validate's formats and never asks for torch (a peer dependency)
    core = requires("rlk-core")
    assert [r for r in core if r.startswith("rlk-")] == ["rlk-validate==0.1.0"], core
    for name in PACKAGES:
        assert not any(r.startswith("torch") for r in requires(name)), (name, requires(name))
    assert any(r.startswith("rlk-core") for r in requires("rlk-collectives"))
    for adapter in ("rlk-vllm-plugin", "rlk-megatron-provider"):
        assert {"rlk-core", "rlk-collectives"} <= {r.split("=")[0].split(">")[0] for r in requires(adapter)}


def test_entry_points(wheels):
    assert "rlk-selfcheck = rlk_core.selfcheck:main" in _metadata(wheels["rlk-core"])[1]
    assert "[vllm.general_plugins]" in _metadata(wheels["rlk-vllm-plugin"])[1]
    assert "rlk-validate" in _metadata(wheels["rlk-validate"])[1]
    assert "rlk-repro" in _metadata(wheels["rlk-repro"])[1]
    assert "rlk.backends" not in _metadata(wheels["rlk-core"])[1]  # the group is for other packages' backends
    _, _, names = _metadata(wheels["rlk-validate"])
    assert "rlk_validate/schemas/readback.v1.json" in names


def test_wheel_metadata_uses_spdx_license(wheels):
    for name, wheel in wheels.items():
        meta, _, _ = _metadata(wheel)
        assert meta["License-Expression"] == "Apache-2.0", name


@pytest.mark.slow
def test_wheels_install_into_an_environment_with_torch_and_leave_it_alone(tmp_path):
    """scripts/build-wheels.sh, then scripts/check-wheel-install.sh: a fresh venv with a CPU torch gets
    each adapter from the wheel folder; torch is the same before and after, imports are silent."""
    env = {**os.environ, "RLK_BUILD_EXT": "0", "PYTHON": sys.executable}
    build = subprocess.run(["bash", str(ROOT / "scripts" / "build-wheels.sh"), str(tmp_path / "wheels")],
                           capture_output=True, text=True, env=env, timeout=600)
    assert build.returncode == 0, build.stderr
    assert "warning" not in (build.stdout + build.stderr).lower(), build.stdout + build.stderr
    check = subprocess.run(["bash", str(ROOT / "scripts" / "check-wheel-install.sh"), str(tmp_path / "wheels")],
                           capture_output=True, text=True, timeout=900)
    assert check.returncode == 0, check.stdout + check.stderr
    for pkg in ("rlk-vllm-plugin", "rlk-megatron-provider"):
        assert f"rlk: {pkg} installed; torch unchanged" in check.stdout


# vLLM 0.22 decorates with torch.jit.script_method, which torch 2.13 deprecates at import
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_adapters_fail_closed_for_r_routes_they_cannot_install(monkeypatch):
    import rlk_vllm_plugin
    from rlk_core.errors import RlkPolicyError
    from rlk_megatron_provider import initialize_from_environment
    from rlk_vllm_plugin import _compat

    monkeypatch.setenv("RL_KERNEL_FFN_CASE", "R/R")
    # vLLM settles its platform once per process: on this CPU machine, the test-only CPU platform (tests/vllm)
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    # A vLLM the plugin cannot hook (one target renamed), or no vLLM at all: strict mode refuses, naming it.
    monkeypatch.setitem(_compat.TARGETS, "ffn", ("vllm.model_executor.layers.activation:RenamedSiluAndMul.x",))
    with pytest.raises(RlkPolicyError, match=r"rollout side of ffn, but vLLM (cannot be imported|.* lacks: "
                                             r"vllm\.model_executor\.layers\.activation:RenamedSiluAndMul)"):
        rlk_vllm_plugin.register()
    # A megatron-core outside the verified range (or none): strict mode refuses, naming the module.
    import types

    import rlk_megatron_provider

    fake = types.SimpleNamespace(supported=lambda: (False, "megatron-core 0.15.0 is outside the verified range"))
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "rlk_megatron_provider._compat", fake)
        m.setattr(rlk_megatron_provider, "_compat", fake, raising=False)
        with pytest.raises(RlkPolicyError, match="module 'ffn'.*0.15.0 is outside the verified range"):
            initialize_from_environment()
    monkeypatch.setenv("RL_KERNEL_FFN_CASE", "P/P")
    try:
        rlk_vllm_plugin.register()  # all P: nothing refused (only counting hooks: tests/vllm/test_counting.py)
        rt = rlk_vllm_plugin._runtime.current()
        assert rt is not None and not any(rt.r(m) for m in ("attention", "ffn", "logp"))
    finally:
        rlk_vllm_plugin.uninstall()
    initialize_from_environment()
