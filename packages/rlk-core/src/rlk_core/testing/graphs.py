"""CUDA-graph capture for tests: warm a call up, then capture it, the way vLLM captures its decode steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def capture(fn: Callable[[], Any]) -> tuple[Any, Any]:
    """Warm ``fn`` up twice on a side stream (compilation, allocator), then capture one call; returns
    ``(graph, output of the captured call)``. Replaying the graph rewrites that output in place."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
