"""Two real hosts, and Slurm.

Two hosts on one machine: two network namespaces joined by a veth pair, each with its own
address (``ip netns``, as root). One ``hfpipe finetune --nnodes 2 --node-rank I --rdzv-endpoint
HOST:PORT`` starts in each; the run must end bitwise equal (losses, grad norms, exported weights)
to the same run on one node. Where namespaces cannot be made the test skips, saying why.

Slurm: the worker entry point under the variables ``srun`` sets for 2 nodes x 2 tasks maps onto
the global ranks, local ranks and rendezvous address torch expects.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _dist import tiny_checkpoint

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
TIMEOUT_S = 600


def _run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)


class TwoHosts:
    """Namespaces ``<tag>a``/``<tag>b`` with 10.231.<n>.1 and .2 on a veth pair."""

    def __init__(self) -> None:
        tag = f"hfp{os.getpid() % 100000}"
        self.ns = (tag + "a", tag + "b")
        self.dev = (tag + "va", tag + "vb")
        n = random.randint(1, 250)
        self.addr = (f"10.231.{n}.1", f"10.231.{n}.2")
        steps = [["ip", "netns", "add", self.ns[0]], ["ip", "netns", "add", self.ns[1]],
                 ["ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1]]]
        for i in (0, 1):
            steps += [["ip", "link", "set", self.dev[i], "netns", self.ns[i]],
                      ["ip", "-n", self.ns[i], "addr", "add", self.addr[i] + "/24", "dev", self.dev[i]],
                      ["ip", "-n", self.ns[i], "link", "set", self.dev[i], "up"],
                      ["ip", "-n", self.ns[i], "link", "set", "lo", "up"]]
        for step in steps:
            out = _run(step)
            if out.returncode:
                self.close()
                raise OSError(f"{' '.join(step)}: {out.stderr.strip()}")

    def popen(self, i: int, args: list, cwd: Path) -> subprocess.Popen:
        # gloo binds to the address of the interface named here (in the namespace, the host
        # name resolves to no local address)
        env = {**ENV, "GLOO_SOCKET_IFNAME": self.dev[i]}
        return subprocess.Popen(["ip", "netns", "exec", self.ns[i], sys.executable, "-m", "hfpipe.cli.main",
                                 *map(str, args)], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def close(self) -> None:
        for ns in self.ns:
            _run(["ip", "netns", "del", ns])  # takes its end of the veth pair with it


@pytest.fixture
def two_hosts():
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (apt-get install iproute2)")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    try:
        hosts = TwoHosts()
    except OSError as e:
        pytest.skip(f"cannot make network namespaces here: {e}")
    yield hosts
    hosts.close()


def _finetune_args(model, pp: int, dp: int, out: str, ep: int = 1) -> list:
    return ["finetune", model, "--pp", pp, "--dp", dp, "--ep", ep, "--max-steps", 3, "--seq-len", 32, "--batch-size", 4,
            "--microbatches", 2, "--lr", 3e-3, "--warmup-steps", 1, "--output-dir", out, "--save-hf-at-end",
            "--threads-per-rank", 1]


def _results(out: Path) -> tuple[list, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    metrics = [(r["step"], r["loss"], r["grad_norm"], r["tokens"]) for r in rows]
    weights = {p.name: p.read_bytes() for p in sorted((out / "hf").glob("*.safetensors"))}
    return metrics, weights


@pytest.mark.parametrize("pp, dp, ep, kind", [
    (2, 1, 1, "llama_tied"),
    pytest.param(2, 2, 1, "llama_tied", marks=pytest.mark.slow),
    # one pipeline per host: every expert all-to-all crosses the hosts
    pytest.param(2, 2, 2, "qwen3_moe", marks=pytest.mark.slow),
])
def test_two_hosts_end_bitwise_equal_to_one(two_hosts, tmp_path, pp, dp, ep, kind):
    model = tiny_checkpoint(kind, num_hidden_layers=4)
    one = subprocess.run([sys.executable, "-m", "hfpipe.cli.main", *map(str, _finetune_args(model, pp, dp, "one", ep))],
                         cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert one.returncode == 0, one.stderr[-3000:]
    endpoint = f"{two_hosts.addr[0]}:{random.randint(20000, 60000)}"
    nodes = [two_hosts.popen(i, _finetune_args(model, pp, dp, "two", ep) + [
        "--nnodes", 2, "--node-rank", i, "--rdzv-endpoint", endpoint], tmp_path) for i in (0, 1)]
    try:
        outs = [n.communicate(timeout=TIMEOUT_S)[0] for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    for i, (n, text) in enumerate(zip(nodes, outs)):
        assert n.returncode == 0, f"node {i}:\n{text[-3000:]}"
    metrics1, weights1 = _results(tmp_path / "one")
    metrics2, weights2 = _results(tmp_path / "two")
    assert len(metrics1) == 3 and weights1
    assert metrics2 == metrics1, "losses and grad norms, bit for bit"
    assert weights2 == weights1, "exported weights, bit for bit"


SLURM_WORKER = """
import json, os
from hfpipe.parallel.mesh import init_distributed
d = init_distributed(2, 2)
print(json.dumps({"rank": d.rank, "world": d.world, "pp_rank": d.pp_rank, "dp_rank": d.dp_rank,
                  "local_rank": int(os.environ["LOCAL_RANK"])}))
"""


def test_slurm_tasks_map_to_torch_ranks():
    """2 nodes x 2 tasks as srun starts them: the real entry (init_distributed) on each task."""
    from hfpipe.parallel.mesh import _free_port

    port = str(_free_port())
    base = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    procs = []
    for node in range(2):
        for local in range(2):
            env = {**base, "SLURM_PROCID": str(2 * node + local), "SLURM_NTASKS": "4", "SLURM_LOCALID": str(local),
                   "SLURM_NODEID": str(node), "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "localhost",
                   "MASTER_PORT": port}
            procs.append(subprocess.Popen([sys.executable, "-c", SLURM_WORKER], env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    seen = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert [s["rank"] for s in seen] == [0, 1, 2, 3] and {s["world"] for s in seen} == {4}
    assert [s["local_rank"] for s in seen] == [0, 1, 0, 1]
    # the mesh is (pp, dp, cp, tp), pp outermost (hfpipe.parallel.dims): a node's two tasks are the dp
    # replicas of one pipeline rank, and only activations cross between the nodes
    assert [(s["dp_rank"], s["pp_rank"]) for s in seen] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_the_first_node_of_a_slurm_job_hosts_the_rendezvous():
    from hfpipe.parallel.mesh import first_host

    assert first_host("gpu[07-08,10]") == "gpu07"
    assert first_host("node3,node4") == "node3"
    assert first_host("a[1-2],b[3]") == "a1"
    assert first_host("single") == "single"


TORCHRUN_NODE_1 = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                   "GROUP_WORLD_SIZE": "2"}
SLURM_NODE_1 = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NNODES": "2"}


@pytest.mark.parametrize("env, node", [(TORCHRUN_NODE_1, (2, 1, 0)), (SLURM_NODE_1, (2, 1, 1)),
                                       ({"RANK": "0", "WORLD_SIZE": "1"}, (1, 0, 0))])
def test_a_launched_worker_knows_its_node(monkeypatch, env, node):
    from hfpipe.parallel.mesh import launched_node

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "GROUP_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert launched_node() == node


def test_under_torchrun_local_rank_0_holds_its_nodes_lock_and_a_busy_folder_is_refused(tmp_path, monkeypatch):
    """Two runs into one folder are refused under torchrun/srun too, node by node, before any work."""
    from hfpipe.config.run import FinetuneConfig
    from hfpipe.parallel.lock import FolderBusyError, run_lock
    from hfpipe.train import runner

    for k, v in TORCHRUN_NODE_1.items():  # rank 2 = local rank 0 of node 1 (of 2)
        monkeypatch.setenv(k, v)
    out = tmp_path / "run"
    cfg = FinetuneConfig(model=str(tiny_checkpoint("llama")), output_dir=str(out), pp=2, dp=2, batch_size=2,
                         seq_len=32, max_steps=1)
    held = []

    def worker(cfg_dict):
        with pytest.raises(FolderBusyError, match=f"--output-dir {out} is in use by process {os.getpid()}"):
            run_lock(out, 2, 1).check()
        run_lock(out, 2, 0).check()  # the other node's lock is not this process's to hold
        held.append(True)
        return {"step": 1}

    monkeypatch.setattr(runner, "run_worker", worker)
    assert runner.run_finetune(cfg) == {"step": 1} and held
    assert not (out / ".hfpipe.node1.lock").exists()  # released at the end
    with run_lock(out, 2, 1):  # another run on node 1 holds the folder: refused before the worker starts
        held.clear()
        with pytest.raises(FolderBusyError, match="choose another --output-dir"):
            runner.run_finetune(cfg)
        assert not held
