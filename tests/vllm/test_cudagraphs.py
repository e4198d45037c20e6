"""The CUDA-graph evidence of the plugin (rlk_vllm_plugin.cudagraphs) on vLLM's own Model Runner V2
``CudaGraphManager``: its real ``_init_candidates`` and ``dispatch`` run on the CPU; only ``capture`` needs a GPU, so
the test fills ``manager.graphs`` with one entry per descriptor vLLM would capture, as ``capture`` does. The
readback's ``cuda_graphs`` is then checked by rlk-validate's gate (rlk_validate.cuda_graphs)."""

import inspect
import json

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

SIZES = list(range(1, 9))


def _manager(sizes=SIZES, mode="FULL_DECODE_ONLY", max_num_reqs=8):
    """A real CudaGraphManager without its __init__ (which needs a pipeline group and a GPU graph pool): the fields
    __init__ sets, then vLLM's own _init_candidates; the graphs as capture() leaves them."""
    from vllm.config import CompilationConfig, VllmConfig
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    # max_cudagraph_capture_size: the largest size, as VllmConfig's post-init sets it (0.33's _init_candidates reads it)
    cc = CompilationConfig(cudagraph_mode=mode, cudagraph_capture_sizes=list(sizes),
                           max_cudagraph_capture_size=max(sizes))
    m = object.__new__(CudaGraphManager)
    m.compilation_config, m.cudagraph_mode, m.max_num_reqs, m.decode_query_len = cc, cc.cudagraph_mode, max_num_reqs, 1
    # _candidates: 0.33 fills the dict __init__ leaves (setdefault); 0.22 replaces it with a list
    m.graphs, m._graphs_captured, m._candidates, m._capture_descs = {}, False, {}, {}
    # the fields 0.33's __init__ adds (no LoRA, no speculative decoding, no micro-batching); unused by 0.22
    m.vllm_config, m.varlen_decode, m.ubatch_runner, m.lora_capture_cases = VllmConfig(), False, None, [0]
    m._lora_dispatch_map, m._max_lora_case = {}, 0
    m._init_candidates()
    m.graphs = {d: object() for descs in m._capture_descs.values() for d in descs}  # capture()'s result
    m._graphs_captured = True
    return m


def _dispatch(m, num_reqs, num_tokens, uniform, by_keyword=False):
    """``m.dispatch`` with the installed vLLM's arguments: 0.33 also requires ``num_active_loras`` (0: no LoRA), and
    calls it by keyword where 0.22's runner passes the three positionally."""
    extra = {"num_active_loras": 0} if "num_active_loras" in inspect.signature(m.dispatch).parameters else {}
    if by_keyword:
        return m.dispatch(num_reqs=num_reqs, num_tokens=num_tokens, uniform_token_count=uniform, **extra)
    return m.dispatch(num_reqs, num_tokens, uniform, **extra)


@pytest.fixture
def graphs():
    from rlk_vllm_plugin import cudagraphs

    cudagraphs.RECORD.reset()
    yield cudagraphs
    cudagraphs.RECORD.reset()


def test_dispatch_is_wrapped_for_every_plan_and_restored(plugin, graphs):
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    original = CudaGraphManager.dispatch
    rt = plugin()  # all P: counting only
    assert CudaGraphManager.dispatch is not original
    assert any(h["name"] == "cuda_graphs" for h in rt.recorder.to_dict()["hooks"])
    import rlk_vllm_plugin

    rlk_vllm_plugin.uninstall()
    assert CudaGraphManager.dispatch is original


def test_each_step_is_counted_with_the_settings_and_the_captured_graphs(plugin, graphs):
    rt = plugin(ffn="R/R")
    m = _manager()
    decisions = [_dispatch(m, b, b, 1) for b in (8, 5, 1)]  # decode steps
    decisions.append(_dispatch(m, 8, 8, 1, by_keyword=True))  # as 0.33's runner calls it
    decisions.append(_dispatch(m, 3, 40, None, by_keyword=True))  # a prefill step
    assert [d.cg_mode.name for d in decisions] == ["FULL"] * 4 + ["NONE"]  # the results are vLLM's, unchanged
    doc = rt.recorder.to_dict()["cuda_graphs"]
    assert doc["recorded"] is True and doc["settings"] == {
        "compilation_mode": doc["settings"]["compilation_mode"], "cudagraph_mode": "FULL_DECODE_ONLY",
        "capture_sizes": SIZES, "decode_query_len": 1, "max_num_reqs": 8}
    assert sorted(c["num_tokens"] for c in doc["captured"]) == SIZES
    assert {c["mode"] for c in doc["captured"]} == {"FULL"}
    assert doc["dispatch"] == [
        {"mode": "FULL", "graph_tokens": 1, "batch_tokens": 1, "num_reqs": 1, "decode": True, "count": 1},
        {"mode": "FULL", "graph_tokens": 5, "batch_tokens": 5, "num_reqs": 5, "decode": True, "count": 1},
        {"mode": "FULL", "graph_tokens": 8, "batch_tokens": 8, "num_reqs": 8, "decode": True, "count": 2},
        {"mode": "NONE", "graph_tokens": 40, "batch_tokens": 40, "num_reqs": 3, "decode": False, "count": 1}]


def _gate(tmp_path, rt, sizes=SIZES):
    """rlk-validate's CUDA-graph gate on the flushed readback, for a run that asked for FULL_DECODE_ONLY 1..8."""
    from rlk_validate.cuda_graphs import check_cuda_graphs
    from rlk_validate.safeio import Caps, Root

    run = tmp_path / "run"
    rt.recorder.flush(run / "readbacks")
    doc = json.loads(next((run / "readbacks").iterdir()).read_text())
    assert "cuda_graphs" in doc
    manifest = {"config": {"cuda_graphs": {"cudagraph_mode": "FULL_DECODE_ONLY", "capture_sizes": list(sizes)}}}
    return [f.code for f in check_cuda_graphs(Root(str(run), Caps(), check="run"), manifest)]


def test_a_run_whose_decode_replayed_its_graphs_passes_the_gate(plugin, graphs, tmp_path):
    rt = plugin()
    m = _manager()
    for b in SIZES:
        _dispatch(m, b, b, 1)
    assert _gate(tmp_path, rt) == ["CUDA_GRAPH_SUMMARY"]


def test_a_decode_batch_beyond_the_captured_sizes_runs_eager_and_fails_the_gate(plugin, graphs, tmp_path):
    """vLLM capped the capture sizes at max_num_reqs 4, so the decode steps of batches 5..8 ran eagerly."""
    rt = plugin()
    m = _manager(max_num_reqs=4)
    for b in SIZES:
        _dispatch(m, b, b, 1)
    codes = _gate(tmp_path, rt)
    assert "CUDA_GRAPH_DECODE_EAGER" in codes and "CUDA_GRAPH_NOT_CAPTURED" in codes, codes


def test_piecewise_graphs_are_not_the_profile_asked_for(plugin, graphs, tmp_path):
    rt = plugin()
    m = _manager(mode="PIECEWISE")
    for b in SIZES:
        _dispatch(m, b, b, 1)
    codes = _gate(tmp_path, rt)
    assert "CUDA_GRAPH_SETTINGS_MISMATCH" in codes and "CUDA_GRAPH_DECODE_EAGER" in codes, codes
