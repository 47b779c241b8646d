"""FSDP2 training across pseudo-nodes, side by side in one run: stock FSDP2 on a gloo
group, tide fp32 and tide bf16 mixed precision (TIDE-AG across nodes over gloo; the
reduce-scatter across nodes is still FSDP2's stock one). One machine is split into nodes
with TIDE_LOCAL_WORLD_SIZE: real ranks and the real inter-node engine, but the "network"
is loopback TCP on the same cores, so these ratios say what the layout copies and the
schedule cost here, not what a cluster's NICs would show (that is the model's job).

    scripts/env python benchmarks/pseudo_nodes.py [--topologies 2x1 2x2] [--steps 6]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))


def main(argv=None):
    from tide import demo

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topologies", nargs="+", default=["2x1", "2x2"], help="NODESxRANKS_PER_NODE")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args(argv)
    import torch

    print(f"torch {torch.__version__}; {os.cpu_count()} CPUs")
    for topo in args.topologies:
        nodes, local = (int(x) for x in topo.split("x"))
        ws = nodes * local
        os.environ["TIDE_LOCAL_WORLD_SIZE"] = str(local)  # the rank processes inherit it
        print(f"\n== {nodes} pseudo-nodes x {local} ranks (world size {ws}), {args.steps} steps, "
              f"batch {args.batch} x {args.seq} tokens per rank", flush=True)
        results = {run.label: demo.run_one(run, ws, args.steps, args.batch, args.seq) for run in demo.RUNS}
        demo.print_table(results, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
