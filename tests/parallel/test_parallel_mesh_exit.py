"""Spec of hfpipe.parallel.mesh at exit: the process group is ended while the interpreter is alive.

A group left to the interpreter's finalisation can abort a gloo rank ("terminate called without an active
exception", seen in CI after a PipelineTrainer run) and makes NCCL warn on every rank. Under torchrun,
transformers' ``TrainingArguments`` starts the group before hfpipe sees it, so hfpipe ends it either way.
"""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import atexit, os
    import torch.distributed as dist
    from hfpipe.parallel.mesh import _free_port, init_distributed

    # registered first, so it runs last: what is left once every other exit handler has run
    atexit.register(lambda: print("initialised at exit:", dist.is_initialized(), flush=True))
    if {started_by_script}:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
        dist.init_process_group("gloo")
    init_distributed(1)
    print("initialised:", dist.is_initialized(), flush=True)
""")


@pytest.mark.parametrize("started_by_script", [False, True], ids=["hfpipe-started", "script-started"])
def test_the_group_is_ended_before_the_interpreter_finalises(started_by_script):
    code = SCRIPT.format(started_by_script=started_by_script)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "initialised: True" in out.stdout
    assert "initialised at exit: False" in out.stdout


CYCLE = textwrap.dedent("""
    import atexit, os
    import torch.distributed as dist
    from hfpipe.parallel.mesh import init_distributed

    def threads():
        return len(os.listdir("/proc/self/task"))

    before = threads()
    # registered first, so it runs last: the threads left once every other exit handler has run
    atexit.register(lambda: print("threads left at exit:", threads() - before, flush=True))
    init_distributed(1)

    class Holder:  # a Trainer and its callbacks: the group reachable only through a cycle
        pass

    holder = Holder()
    holder.group, holder.me = dist.new_group([0]), holder
    dist.all_reduce(__import__("torch").ones(1), group=holder.group)
    print("threads while running:", threads() - before, flush=True)
    del holder
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_a_group_a_cycle_holds_is_gone_before_the_interpreter_finalises():
    """Its gloo threads left to finalization can abort the rank (CI, after PipelineDPOTrainer.save_model)."""
    out = subprocess.run([sys.executable, "-c", CYCLE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    running = int(out.stdout.split("threads while running:")[1].split()[0])
    left = int(out.stdout.split("threads left at exit:")[1].split()[0])
    assert running > 0 and left <= 0, out.stdout
