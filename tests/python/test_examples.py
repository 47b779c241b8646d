"""The example a user copies (examples/train_llama.py) runs as its docstring says, with
torchrun, and takes TIDE's path."""
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_the_example_trains_with_torchrun(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "python"), "USE_LIBUV": "0", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          os.path.join(ROOT, "examples", "train_llama.py"), "--steps", "3",
                          "--checkpoint", str(tmp_path / "ckpt")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in run.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and all(0 < x < 10 for x in losses), run.stdout
    paths = next(line for line in run.stdout.splitlines() if line.startswith("tide paths:"))
    assert "'stock_all_gather': 0" in paths and "'stock_reduce_scatter': 0" in paths, paths
    assert "'zero_copy_all_gather': 0" not in paths, paths
    assert (tmp_path / "ckpt" / ".metadata").exists()
