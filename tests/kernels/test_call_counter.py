"""The plugin's call counter: host counting on CPU, device counting (CUDA-graph replays included) on a GPU."""

from __future__ import annotations

import json
import time

import pytest
import torch

from moe_eval.core.plugin_protocol import STATS_INTERVAL_SECONDS
from moe_eval.kernels.call_counter import CallCounter
from tests.kernels.conftest import HAS_GPU


def test_host_counting_on_cpu_is_flushed_to_its_file(tmp_path):
    path = tmp_path / "kernel-stats" / "123.json"
    counter = CallCounter("torch", path)
    for tokens in (3, 5, 7):
        counter.count(torch.zeros(tokens, 4))
    time.sleep(STATS_INTERVAL_SECONDS * 3)  # the flusher thread writes on its own
    record = json.loads(path.read_text())
    assert record["calls"] == record["python_calls"] == 3 and record["tokens"] == 15
    assert record["counted_on"] == "host" and "device_problem" not in record


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
def test_cuda_graph_replays_are_counted_on_the_device(tmp_path):
    counter = CallCounter("triton", tmp_path / "c.json")
    counter.attach_device()
    assert counter.device_problem is None, counter.device_problem
    x = torch.randn(16, 8, device="cuda")
    counter.count(x)  # eager
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        counter.count(x)  # captured: not run now, run on every replay
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    record = counter.snapshot()
    assert record["counted_on"] == "device"
    assert record["calls"] == 1 + 10 and record["tokens"] == 16 * 11
    assert record["python_calls"] == 2  # what a Python-side counter would have said
