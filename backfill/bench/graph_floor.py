"""The launch-bound floor of a CUDA-graph decode step, for models too small to be bound by HBM.

A 135M-parameter model's decode step reads ~0.3 GB of bf16 weights: ~0.07 ms at an H200's
4.3 TB/s, far below what its hundreds of small kernels take to run one after another even from
a CUDA graph (each node waits for the one before it, ~1-2 us apart). For such a model the
honest bound is not the HBM roofline but the graph itself: the same number of kernel nodes,
each doing (next to) nothing, replayed as one graph. `measure_graph_floor` measures both:

- `kernels`: the kernels (and memsets / copies) one eager run of the captured step launches,
  counted by the profiler: the nodes its graph holds;
- `floor_ms`: the replay of a graph of that many one-element in-place adds, chained as the
  step's nodes are;
- `replay_ms`: the replay of the step's own graph (GPU time, no host work around it).

`measured_ms / floor_ms` then says how far a real step (host bookkeeping, buffer copies and
sampling included) is from the least a graph of that many nodes can take.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch


def _median_replay_ms(graph: torch.cuda.CUDAGraph, repeats: int) -> float:
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def count_step_kernels(graph_runner: Any, size: int, num_blocks: int) -> int:
    """Device activities (kernels, memsets, copies) of one eager run of the (size, num_blocks)
    decode step over the graph runner's buffers (left filled with that step's padding rows)."""
    from torch.profiler import ProfilerActivity, profile

    graph_runner.buffers.fill(None, size, num_blocks)  # padding only: writes the scratch block
    graph_runner._forward(size, num_blocks)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph_runner._forward(size, num_blocks)
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


@torch.inference_mode()
def empty_graph_ms(num_nodes: int, device: torch.device, repeats: int = 50) -> float:
    """Replay time (ms) of a graph of `num_nodes` chained one-element adds."""
    x = torch.zeros(1, device=device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        x.add_(1)  # warm-up outside the capture
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(num_nodes):
            x.add_(1)
    return _median_replay_ms(graph, repeats)


@torch.inference_mode()
def measure_graph_floor(graph_runner: Any, batch_size: int, context_len: int) -> dict[str, Any] | None:
    """The floor of a `batch_size`-row decode step at `context_len` tokens of context on
    `graph_runner` (worker/cuda_graph.CudaGraphRunner, captured), or None where that step runs
    without a graph (more rows or blocks than any graph holds)."""
    from backfill.worker.cuda_graph import DecodeInputs

    blocks = -(-(context_len + 1) // graph_runner.block_size)
    step = DecodeInputs(input_ids=[0] * batch_size, positions=[0] * batch_size,
                        block_tables=[[graph_runner.buffers.scratch_block] * blocks] * batch_size,
                        sample_rows=list(range(batch_size)))
    key = graph_runner.graph_key(step)
    if key is None or key not in graph_runner.graphs:
        return None
    kernels = count_step_kernels(graph_runner, *key)  # the buffers then hold the dummy step the replay reads
    return {
        "graph_key": list(key),
        "kernels": kernels,
        "replay_ms": _median_replay_ms(graph_runner.graphs[key], 50),
        "floor_ms": empty_graph_ms(kernels, graph_runner.device),
    }
