"""Readbacks from every vLLM process carry what ran, whatever the process layout (issue 41, defect 14).

Under ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (how ``vllm serve`` and VIME run vLLM) the engine core, and the
executor's workers, are ``multiprocessing`` children: they end in ``os._exit`` after multiprocessing's finalizers,
never running ``atexit``, so a readback flushed at exit only was the one written at start-up — hooks installed, no
module. Here a child started by vLLM's own multiprocessing context (fork and spawn) loads the plugins and the model
the way an engine core does, runs layers, and is stopped by vLLM's own ``shutdown`` (SIGTERM, then a kill), or
killed outright; its readback must record the calls. (The whole ``vllm.LLM`` cannot start on this CPU install: vLLM's
CPU worker calls its compiled CPU ops, absent from the CUDA wheel, e.g. ``torch.ops._C.init_cpu_memory_env``.)"""

from __future__ import annotations

import json
import socket

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")]

PARENT = r'''
import os, signal, sys, time
from vllm.utils.system_utils import get_mp_context
from vllm.v1.utils import shutdown
import vllm_tiny
from rlk_vllm_plugin import _runtime
ctx = get_mp_context()
ready = ctx.Event()
proc = ctx.Process(target=vllm_tiny.engine_core, args=(ready,), name="EngineCore")
proc.start()
try:
    assert ready.wait(300), "the engine core did not start"
    if os.environ["STOP"] == "kill":  # no exit hook at all: what the flusher wrote is what is left
        time.sleep(getattr(_runtime, "FLUSH_EVERY_S", 2.0) + 2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
    else:
        shutdown([proc])  # vLLM's own: SIGTERM, join, then kill the tree
finally:
    if proc.is_alive():  # never leave the child behind
        proc.kill()
        proc.join()
print("child", proc.pid, proc.exitcode)
print("ok")
'''


@pytest.mark.parametrize("method,stop", [("fork", "sigterm"), ("spawn", "kill")])
def test_the_engine_core_process_readback_records_what_ran(run_script, tmp_path, method, stop):
    env = {"RL_KERNEL_ATTENTION_CASE": "P/P", "RL_KERNEL_FFN_CASE": "P/P", "RL_KERNEL_LOGP_CASE": "P/P",
           "RL_KERNEL_MODE": "strict", "RL_KERNEL_READBACK_DIR": str(tmp_path / "rb"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": method, "STOP": stop}
    out = run_script(PARENT, env=env)
    pid, code = (int(x) for x in out.split("child ", 1)[1].split()[:2])
    assert code == (-9 if stop == "kill" else 0), out
    doc = json.loads((tmp_path / "rb" / socket.gethostname() / f"vllm-rollout-{pid}.json").read_text())
    assert doc["pid"] == pid and doc["hooks"]
    calls = {m: r["call_count"] for m, r in doc["modules"].items()}
    assert calls.get("ffn", 0) >= 4 and calls.get("logp", 0) >= 1, calls  # norm, 2 linears, SwiGLU; final norm
