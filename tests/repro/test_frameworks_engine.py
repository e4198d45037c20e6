"""``rlk-repro run --engine frameworks`` on the CPU: the one-line refusal (and that nothing is created), its
argument handling, the matrix cell's command line, the Megatron -> Hugging Face weight mapping (exact, every
TP split; into real vLLM 0.22's Qwen3 ``load_weights``: every vLLM parameter gets exactly its tensor), and the
Megatron train side (real megatron-core on gloo: its log-probs equal the local trainer's at the same weights,
bitwise). The GPU loop itself is tested by ``tests/frameworks/test_loop_exact.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rlk_megatron_provider.weights import hf_from_megatron, to_megatron
from rlk_repro import cli
from rlk_repro.engine import frameworks
from rlk_repro.model.config import PRESETS, Qwen3Config
from rlk_repro.model.weights import random_weights, to_hf

ROUTE_VARS = ("RL_KERNEL_ATTENTION_CASE", "RL_KERNEL_FFN_CASE", "RL_KERNEL_LOGP_CASE", "RL_KERNEL_MODE",
              "RL_KERNEL_READBACK_DIR", "RL_KERNEL_RUN_ID", "VLLM_PLUGINS", "WORLD_SIZE")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in ROUTE_VARS:
        monkeypatch.delenv(k, raising=False)


def _no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_refuses_in_one_line_without_gpu_and_creates_nothing(tmp_path, monkeypatch, capsys):
    _no_gpu(monkeypatch)
    out = tmp_path / "runs"
    code = cli.main(["run", "--engine", "frameworks", "--model", "qwen3-0.6b", "--output", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == cli.EXIT_USAGE
    assert len(err.splitlines()) == 1 and "needs a CUDA GPU" in err, err
    assert not out.exists()


def test_matrix_refuses_before_creating_the_root(tmp_path, monkeypatch, capsys):
    _no_gpu(monkeypatch)
    code = cli.main(["matrix", "--engine", "frameworks", "--cells", "control-RR", "--output", str(tmp_path / "m")])
    assert code == cli.EXIT_USAGE and not (tmp_path / "m").exists()
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_requirements_name_every_missing_piece(monkeypatch):
    import importlib.util

    _no_gpu(monkeypatch)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("vllm", "megatron.core") else real(name, *a))
    monkeypatch.setenv("VLLM_PLUGINS", "other")
    why = frameworks.requirements(tp=2)
    for part in ("CUDA GPU", "vLLM", "megatron-core", "VLLM_PLUGINS", "torchrun"):
        assert part in why, why
    assert "\n" not in why


def test_requirements_pass_with_everything_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(frameworks.importlib.util, "find_spec", lambda name, *a: object())

    class EP:
        name, value = "rlk", "rlk_vllm_plugin:register"

    monkeypatch.setattr(frameworks.md, "entry_points", lambda group: [EP()])
    assert frameworks.requirements(tp=1) is None
    monkeypatch.setattr(frameworks.md, "entry_points", lambda group: [])
    assert "entry point" in frameworks.requirements(tp=1)


@pytest.mark.parametrize("argv, message", [
    (["run", "--tp", "2"], "--tp is an option of --engine frameworks"),
    (["run", "--enforce-eager"], "--enforce-eager is an option of --engine frameworks"),
    (["run", "--engine", "frameworks", "--top-p", "0.9", "--logprobs", "unfiltered", "--logp-case", "P/P"],
     "needs rlk on vLLM's logp"),
    (["run", "--engine", "frameworks", "--min-p", "1.5"], "min_p must be in [0, 1]"),
    (["run", "--engine", "frameworks", "--device", "cpu"], "runs on cuda"),
    (["run", "--engine", "frameworks", "--dtype", "float32"], "runs bfloat16"),
    (["run", "--engine", "frameworks", "--gpu-memory-utilization", "1.5"], "gpu-memory-utilization"),
    (["run", "--run-name", "x"], "internal"),
])
def test_bad_arguments_exit_2_before_anything(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == cli.EXIT_USAGE
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_plan_resolves_frameworks_defaults(capsys):
    assert cli.main(["plan", "--engine", "frameworks", "--mode", "native", "--tp", "2", "--enforce-eager"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["engine"] == "frameworks" and doc["mode"] == "native"
    c = doc["config"]
    assert (c["device"], c["dtype"], c["top_p"], c["tp"], c["enforce_eager"]) == ("cuda", "bfloat16", 1.0, 2, True)
    assert cli.main(["plan"]) == 0
    local = json.loads(capsys.readouterr().out)["config"]
    assert (local["device"], local["top_p"]) == ("cpu", 0.95) and "tp" not in local


def test_matrix_cell_command_line_round_trips():
    a = cli.build_parser().parse_args(["matrix", "--engine", "frameworks", "--rounds", "3", "--model", "qwen3-0.6b",
                                       "--enforce-eager", "--gpu-memory-utilization", "0.4", "--audit"])
    argv = cli._cell_argv(a, {"attention": "P/R", "ffn": "R/R", "logp": "R/R"}, "/r", "attention-PR")
    b = cli.build_parser().parse_args(argv)
    assert (b.command, b.engine, b.output, b.run_name) == ("run", "frameworks", "/r", "attention-PR")
    assert (b.attention_case, b.ffn_case, b.rounds, b.model) == ("P/R", "R/R", 3, "qwen3-0.6b")
    assert b.enforce_eager and b.audit and b.gpu_memory_utilization == 0.4 and b.device is None


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_from_megatron_is_exact_for_every_tp_split(tp, tied):
    cfg = Qwen3Config(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied)
    w = random_weights(cfg, 7)
    got = list(hf_from_megatron(cfg, [to_megatron(cfg, w, tp, r) for r in range(tp)]))
    want = to_hf(cfg, w)
    assert [n for n, _ in got] == list(dict(got)) and set(dict(got)) == set(want)
    assert all(torch.equal(t, want[n]) for n, t in got)
    bad = dict(got)  # negative control: a swapped layout is caught
    assert not torch.equal(bad["model.layers.0.self_attn.q_proj.weight"],
                           to_megatron(cfg, w, 1, 0)["decoder.layers.0.self_attention.linear_qkv.weight"][:32])


def _script(body: str, env: dict[str, str], tmp_path, timeout: int = 600) -> str:
    full = {k: v for k, v in os.environ.items() if k not in ROUTE_VARS}
    full.update({"PYTHONWARNINGS": "ignore", "TEST_MEGATRON_DIR": os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron"), **env})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True,
                          timeout=timeout, env=full, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


VLLM_LOAD = r'''
import os, tempfile, torch
from vllm.plugins import load_general_plugins
load_general_plugins()
from rlk_repro.model.config import Qwen3Config
from rlk_repro.model import weights as W
from rlk_megatron_provider.weights import to_megatron, hf_from_megatron
from rlk_vllm_plugin.weight_sync import load_into_model, derived_copies
for tied in (True, False):
    cfg = Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                      rms_norm_eps=1e-6, tie_word_embeddings=tied)
    d = tempfile.mkdtemp(); W.save_checkpoint(d, cfg, W.random_weights(cfg, 3, torch.bfloat16))
    from vllm.config import ModelConfig, VllmConfig, CompilationConfig, LoadConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model_loader
    mc = ModelConfig(model=d, skip_tokenizer_init=True, dtype=torch.bfloat16, enforce_eager=True)
    vc = VllmConfig(model_config=mc, load_config=LoadConfig(load_format="dummy"),
                    compilation_config=CompilationConfig(custom_ops=["none"], mode=0))
    with set_current_vllm_config(vc):
        if not torch.distributed.is_initialized():
            init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{d}/dist",
                                         local_rank=0, backend="gloo")
            initialize_model_parallel(1, 1)
        model = get_model_loader(vc.load_config).load_model(vllm_config=vc, model_config=mc)
        assert derived_copies(model) == []
        w = W.random_weights(cfg, 5, torch.bfloat16)
        res = load_into_model(model, hf_from_megatron(cfg, [to_megatron(cfg, w, 2, r) for r in range(2)]))
        p = dict(model.named_parameters())
        assert res["loaded"] == res["parameters"] == len(p) == res["changed"], res
        hf = W.to_hf(cfg, w)
        fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
        for name, t in p.items():
            parts = next(([name.replace(f, x) for x in xs] for f, xs in fused.items() if f in name), [name])
            assert torch.equal(t, torch.cat([hf[q] for q in parts])), name
        again = load_into_model(model, hf_from_megatron(cfg, [to_megatron(cfg, w, 1, 0)]))
        assert again["changed"] == 0, again  # the same weights again: nothing changes
        try:
            load_into_model(model, [(n, t) for n, t in hf_from_megatron(cfg, [to_megatron(cfg, w, 1, 0)])
                                    if "down_proj" not in n])
        except RuntimeError as exc:
            assert "received no weight" in str(exc)
        else:
            raise AssertionError("a missing weight was not reported")
print("ok")
'''


@pytest.mark.vllm
@pytest.mark.slow
def test_megatron_weights_load_into_real_vllm_qwen3(tmp_path):
    _script(VLLM_LOAD, {"VLLM_TARGET_DEVICE": "cpu", "RL_KERNEL_ATTENTION_CASE": "R/R", "RL_KERNEL_FFN_CASE": "R/R",
                        "RL_KERNEL_LOGP_CASE": "R/R", "RL_KERNEL_MODE": "strict",
                        "RL_KERNEL_VLLM_ATTENTION_OVERRIDE": "CPU_ATTN"}, tmp_path)


MEGATRON_STEP = r'''
import os, sys, torch
sys.path.insert(0, os.environ['TEST_MEGATRON_DIR'])
from _cpu import gloo_world_of_one
gloo_world_of_one()
from rlk_repro.engine.frameworks_megatron import MegatronTrainer, init_model_parallel
from rlk_repro.model.config import PRESETS
from rlk_repro.model.weights import random_weights
from rlk_repro.engine.trainer import Sample, Trainer
from rlk_core.plan import RoutePlan
from rlk_core.readback import ReadbackRecorder
from rlk_repro.model.ops import Ops
cfg = PRESETS["tiny"]; w = random_weights(cfg, 3)
init_model_parallel(1, 0)
tr = MegatronTrainer(cfg, w, tp=1, rank=0, device=torch.device("cpu"), dtype=torch.float32, temperature=0.7,
                     optimizer="adamw", lr=1e-3, micro_tokens=40)
g = torch.Generator().manual_seed(0)
samples = [Sample(torch.randint(0, 256, (5 + i,), generator=g).tolist(),
                  torch.randint(0, 256, (3 + 2 * i,), generator=g).tolist(), [], float(i % 3 - 1)) for i in range(6)]
assert len(tr.micro_batches(samples)) > 1
plan = RoutePlan.from_env()
loc = Trainer(cfg, w, Ops(plan, "train", ReadbackRecorder("local", "train", plan)), device=torch.device("cpu"),
              dtype=torch.float32, temperature=0.7)
with torch.no_grad():
    ref = loc.forward_logprobs([s.prompt + s.response for s in samples])
rows = []
start = 0
for s in samples:
    n = len(s.prompt) + len(s.response) - 1
    rows += list(range(start + len(s.prompt) - 1, start + n)); start += n
before = {k: v.detach().clone() for k, v in tr.params.items()}
res = tr.step(samples)
got = torch.cat(res.train_logprobs)
print("equal", torch.equal(got, ref[rows]), float((got - ref[rows]).abs().max()))
assert torch.equal(got, ref[rows]) == (os.environ["EXPECT"] == "equal")
assert res.tokens == start and res.grad_norm > 0
assert any(not torch.equal(before[k], v) for k, v in tr.params.items())  # the step changed the weights
names = [n for n, _ in tr.hf_weights()]
assert len(names) == len(set(names)) and "model.norm.weight" in names
print("ok")
'''


@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.parametrize("case, expect", [("R/R", "equal"), ("P/P", "differs")])
def test_megatron_train_side_matches_local_trainer(tmp_path, case, expect):
    """R/R: the Megatron side's compared log-probs (THD, micro-batched) equal the local trainer's bitwise; P/P
    (stock local spec, padded sbhd) runs and differs (the negative control)."""
    _script(MEGATRON_STEP, {"RL_KERNEL_ATTENTION_CASE": case, "RL_KERNEL_FFN_CASE": case, "RL_KERNEL_LOGP_CASE": case,
                            "RL_KERNEL_MODE": "strict", "EXPECT": expect, "CUDA_VISIBLE_DEVICES": ""}, tmp_path)


def test_presets_used_by_the_gpu_driver_exist():
    assert PRESETS["qwen3-0.6b"].tie_word_embeddings


def test_frameworks_takes_the_real_model_options(hf_model, tmp_path, capsys):
    """issue 37: --model-path, prompt data, chat template, reward and stop tokens reach a frameworks run's configuration
    and a frameworks matrix cell's command line (the run itself needs a GPU: tests/gpu)."""
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "What is 1+1?", "label": "2"}) + "\n")
    opts = ["--engine", "frameworks", "--model-path", str(hf_model), "--prompt-data", str(data),
            "--apply-chat-template", "--apply-chat-template-kwargs", '{"enable_thinking": false}', "--rm-type",
            "deepscaler", "--rollout-stop-token-ids", "3", "4", "--phase", "short"]
    assert cli.main(["plan", *opts]) == 0
    c = json.loads(capsys.readouterr().out)["config"]
    assert (c["model_path"], c["prompt_data"], c["apply_chat_template"], c["rm_type"], c["stop_token_ids"],
            c["chat_template_kwargs"], c["phase"]) == (str(hf_model), str(data), True, "deepscaler", [3, 4],
                                                       {"enable_thinking": False}, "short")
    a = cli.build_parser().parse_args(["matrix", *opts])
    b = cli.build_parser().parse_args(cli._cell_argv(a, {"attention": "R/R", "ffn": "R/R", "logp": "R/R"}, "/r",
                                                     "control-RR"))
    for k in ("model_path", "prompt_data", "apply_chat_template", "apply_chat_template_kwargs", "rm_type",
              "rollout_stop_token_ids", "phase", "input_key", "label_key"):
        assert getattr(b, k) == getattr(a, k), k


def test_a_moe_preset_passes_the_frameworks_layout_check(capsys):
    """The layout check looked the model up in the dense presets only: every frameworks run of a MoE preset stopped
    with KeyError before round 0 (found on the H200, stage moe-loop)."""
    assert cli.main(["plan", "--engine", "frameworks", "--model", "qwen3-moe-30b-a3b-L2"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["model"] == "qwen3-moe-30b-a3b-L2"


# -- emulated train TP (issue 35): --train-tp 4 --emulate-train-tp on one process ---------------------------------
EMULATED_STEPS = r'''
import dataclasses, os, sys, torch
sys.path.insert(0, os.environ['TEST_MEGATRON_DIR'])
from _cpu import gloo_world_of_one
gloo_world_of_one()
from rlk_repro.engine.frameworks_megatron import MegatronTrainer, init_model_parallel
from rlk_repro.model.config import PRESETS
from rlk_repro.model.weights import random_weights
from rlk_repro.engine.trainer import Sample, Trainer
from rlk_core.ops import linear_tp
from rlk_core.plan import RoutePlan
from rlk_core.readback import ReadbackRecorder
from rlk_repro.model.ops import Ops
cfg = dataclasses.replace(PRESETS["tiny"], num_attention_heads=8, num_key_value_heads=4, head_dim=8)
w = random_weights(cfg, 3)
init_model_parallel(1, 0)
emulate = os.environ.pop("RL_KERNEL_TP_EMULATE")
pad = 4 if ",sp" in emulate else 1  # emulated SP: a pack's tokens a multiple of 4 (both sides, as the engine pads)
kw = dict(tp=1, rank=0, device=torch.device("cpu"), dtype=torch.float32, temperature=0.7, optimizer="adamw",
          lr=1e-3, micro_tokens=40, pad_tokens_to=pad)
tp1 = MegatronTrainer(cfg, w, **kw)  # real TP 1, invariant mode
os.environ["RL_KERNEL_TP_EMULATE"] = emulate
emu = MegatronTrainer(cfg, w, **kw)  # built at TP 1, emulating TP 4
row_parallel = {"attention": (cfg.hidden_size, cfg.q_size), "ffn": (cfg.hidden_size, cfg.intermediate_size)}

class TPInvariantOps(Ops):  # the rollout side at TP 1 in invariant mode (vLLM's bits: tests/vllm/test_tp_invariant.py)
    def linear(self, module, x, weight):
        if tuple(weight.shape) != row_parallel.get(module):
            return super().linear(module, x, weight)
        return linear_tp(x, weight, None, 8)

plan = RoutePlan.from_env()
loc = Trainer(cfg, w, TPInvariantOps(plan, "train", ReadbackRecorder("local", "train", plan)),
              device=torch.device("cpu"), dtype=torch.float32, temperature=0.7)
g = torch.Generator().manual_seed(0)
compared = 0
for step in range(3):  # a round each: new samples, one update; the weights move every step
    samples = [Sample(torch.randint(0, 320, (4 + i,), generator=g).tolist(),
                      torch.randint(0, 320, (2 + 2 * i,), generator=g).tolist(), [], float(i % 3 - 1))
               for i in range(6)]
    got, want = emu.step(samples), tp1.step(samples)
    lp, lp1 = torch.cat(got.train_logprobs), torch.cat(want.train_logprobs)
    equal = torch.equal(lp, lp1) and all(torch.equal(emu.params[k], tp1.params[k]) for k in tp1.params)
    if step == 0:
        with torch.no_grad():
            ref = loc.forward_logprobs([s.prompt + s.response for s in samples])
        rows, start = [], 0
        for s in samples:
            n = len(s.prompt) + len(s.response) - 1
            rows += list(range(start + len(s.prompt) - 1, start + n)); start += n
        equal = equal and torch.equal(lp, ref[rows])
    compared += lp.numel()
    print("step", step, "equal", equal, float((lp - lp1).abs().max()))
    assert equal == (os.environ["EXPECT"] == "equal"), step
    if not equal:
        break
print("compared", compared)
print("ok")
'''


@pytest.mark.megatron
@pytest.mark.parametrize("emulate, expect", [("4", "equal"), ("4,sp", "equal"), ("4,bi", "differs")])
def test_megatron_train_side_at_emulated_tp_4_equals_tp_1(tmp_path, emulate, expect):
    """The engine's Megatron side at emulated TP 4 (SP off and on; invariant mode): every step's log-probs and the
    weights after every update == real TP 1's, and step 0's == the TP 1 rollout recompute under rlk.gemm.tp.v1
    (vLLM's bits at TP 1 in invariant mode); the bi split (negative control) differs."""
    _script(EMULATED_STEPS, {"RL_KERNEL_ATTENTION_CASE": "R/R", "RL_KERNEL_FFN_CASE": "R/R",
                             "RL_KERNEL_LOGP_CASE": "R/R", "RL_KERNEL_MODE": "strict", "RL_KERNEL_TP_INVARIANT": "8",
                             "RL_KERNEL_TP_EMULATE": emulate, "EXPECT": expect, "CUDA_VISIBLE_DEVICES": ""}, tmp_path)


def test_plan_records_emulated_train_tp_and_run_accepts_its_layout(capsys):
    from rlk_repro import tp_options

    argv = ["plan", "--engine", "frameworks", "--model", "qwen3-0.6b", "--train-tp", "4", "--rollout-tp", "1",
            "--emulate-train-tp", "--sequence-parallel", "--tp-invariant", "8"]
    assert cli.main(argv) == cli.EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    emu = doc["parallel"]["train_tp_emulated"]
    assert emu["tp"] == 4 and emu["processes"] == 1 and emu["real_train_tp"] == 1 and emu["sequence_parallel"]
    assert "transport" in emu["does_not_prove"] and not emu["negative_control"]
    assert doc["env"]["RL_KERNEL_TP_EMULATE"] == "4,sp" and doc["env"]["RL_KERNEL_TP_INVARIANT"] == "8"
    assert doc["parallel"]["engine_problem"] is None  # run takes it (one process at real TP 1)
    assert doc["config"]["tp"] == 1
    # without the flag the same layout is still refused by run (real train TP != rollout TP on one process)
    cfg = frameworks.FrameworksRunConfig(train_tp=4, rollout_tp=1, tp_invariant=8)
    assert "one TP for both sides" in tp_options.engine_problem(cfg)
    cfg = frameworks.FrameworksRunConfig(train_tp=4, rollout_tp=1, tp_invariant=8, train_tp_emulated="bi-control")
    assert tp_options.env(cfg)["RL_KERNEL_TP_EMULATE"] == "4,bi" and tp_options.emulated(cfg)["negative_control"]


@pytest.mark.parametrize("extra, message", [
    (["--train-tp", "4", "--emulate-train-tp"], "TP-invariant mode only"),
    (["--train-tp", "3", "--emulate-train-tp", "--tp-invariant", "8"], "power of two >= 2"),
    (["--train-tp", "4", "--rollout-tp", "2", "--emulate-train-tp", "--tp-invariant", "8"], "--rollout-tp 1"),
    (["--train-tp", "4", "--emulate-train-tp", "--tp-invariant", "2"], "must divide G=2"),
    (["--train-tp", "4", "--emulate-train-tp", "--tp-invariant", "8", "--context-parallel", "2"], "one process"),
])
def test_emulated_train_tp_refusals(tmp_path, monkeypatch, capsys, extra, message):
    monkeypatch.delenv("RL_KERNEL_TP_INVARIANT", raising=False)
    out = tmp_path / "runs"
    code = cli.main(["run", "--engine", "frameworks", "--model", "qwen3-0.6b", "--output", str(out), *extra])
    err = capsys.readouterr().err.strip()
    assert code == cli.EXIT_USAGE and message in err and len(err.splitlines()) == 1, err
    assert not out.exists()
