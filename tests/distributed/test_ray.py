"""The ray executor on a two-node Ray cluster started on this host (two `ray start` processes, one CPU
each, torn down after): TP=2 places one rank on each node and gives TP=1's greedy tokens (tests/gate.py's
rule). Runs only where ray is installed (`pip install 'vllmpy[ray]'`)."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.distributed.test_tensor_parallel import ENGINE, PROMPTS, _gate, _oracle

# Not imported here: collecting this file must not import ray (test_sharding checks TP never does).
pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray (vllmpy[ray])")
# What `ray start --block` prints once its node is up.
_UP = "This command will now block forever"


def _start_node(args: list[str], temp_dir: str, log: Path) -> subprocess.Popen:
    from vllmpy.distributed.executor import free_port

    command = [str(Path(sys.executable).parent / "ray"), "start", *args, "--num-cpus", "1",
               "--node-ip-address", "127.0.0.1", "--temp-dir", temp_dir, "--disable-usage-stats",
               "--dashboard-agent-listen-port", str(free_port()), "--block"]
    node = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while _UP not in log.read_text():
        if node.poll() is not None or time.monotonic() > deadline:
            node.kill()
            raise RuntimeError(f"ray start did not come up:\n{log.read_text()[-2000:]}")
        time.sleep(0.5)
    return node


@pytest.fixture
def two_node_cluster(monkeypatch, tmp_path):
    """A head and a worker node (distinct temp dirs: short /tmp paths, as Ray's sockets need), RAY_ADDRESS
    pointing at the head; each `ray start --block` takes its node's processes down when terminated."""
    from vllmpy.distributed.executor import free_port

    port = free_port()
    dirs = [tempfile.mkdtemp(prefix="ray", dir="/tmp") for _ in range(2)]
    nodes = [_start_node(["--head", "--port", str(port), "--include-dashboard", "false"], dirs[0],
                         tmp_path / "head.log")]
    try:
        nodes.append(_start_node(["--address", f"127.0.0.1:{port}"], dirs[1], tmp_path / "worker.log"))
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        yield
    finally:
        import ray
        ray.shutdown()
        for node in reversed(nodes):
            node.terminate()
            node.wait(60)
        for path in dirs:
            shutil.rmtree(path, ignore_errors=True)


def test_tp2_across_two_ray_nodes_matches_tp1(two_node_cluster, tiny_llama_dir):
    import ray

    from vllmpy import LLM

    oracle = _oracle(LLM(model=tiny_llama_dir, **ENGINE))
    llm = LLM(model=tiny_llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    try:
        result = _gate(llm, oracle, "ray tp=2")
        assert not result.failures, "\n".join(result.failures)
        assert result.strict + result.near_tie == len(PROMPTS)
        nodes = llm.engine.core.executor.nodes
        assert sorted(nodes) == [0, 1] and nodes[0] != nodes[1]  # one rank on each node
    finally:
        llm.engine.core.shutdown()
    assert ray.util.placement_group_table() == {} or all(
        group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())
