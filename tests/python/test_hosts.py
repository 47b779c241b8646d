"""`torchrun --nnodes 2` on two separate hosts (tests/python/hosts.py: each its own network,
UTS and mount namespaces, joined by TCP only), as users launch multi-node jobs: the group
learns its nodes from the hosts alone (no TIDE_* variable), FSDP2 runs TIDE-AG and TIDE-RS
across the hosts over gloo, and a host that dies is a DistBackendError on every survivor.
Where hosts cannot be made (not root, no iproute2), the tests skip, saying why."""
from __future__ import annotations

import os
import pickle
import sys

import pytest

import hosts
from dist_harness import run_ranks, slack

HERE = os.path.dirname(os.path.abspath(__file__))
PER_HOST = 2


def torchrun_on_two_hosts(out, mode, extra_env=None, timeout=240, until=None):
    why = hosts.why_no_hosts()
    if why:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDE_")}
    env.update(OMP_NUM_THREADS="1", USE_LIBUV="0", **(extra_env or {}))
    commands = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(PER_HOST),
                 "--node-rank", str(i), "--master-addr", hosts.hostname(0), "--master-port", "29500",
                 os.path.join(HERE, "torchrun_train.py"), str(out), mode] for i in range(2)]
    done = hosts.run_on_hosts(commands, env=env, timeout=slack(timeout), until=until)
    results = {}
    for r in range(2 * PER_HOST):
        path = out / f"rank{r}.pkl"
        if path.exists():
            results[r] = pickle.loads(path.read_bytes())
    return done, results


def test_fsdp2_with_torchrun_across_two_hosts(tmp_path):
    """FSDP2 on 2 hosts x 2 ranks: the same bits as stock FSDP2 on gloo summing in TIDE-RS's
    documented order, through TIDE's zero-copy path across the hosts (gloo between them, node
    peers within), with no layout copy in the profiler and no memory shared between hosts."""
    from test_fsdp_zero_copy import AG_COPIES, RS_COPIES, assert_params_equal
    from test_pseudo_nodes import _reference_train_worker, assert_memory_stays_in_nodes

    done, tide = torchrun_on_two_hosts(tmp_path, "train")
    for i, d in enumerate(done):
        assert d.returncode == 0, f"host {i} exited {d.returncode}:\n{d.stdout[-6000:]}"
    assert sorted(tide) == [0, 1, 2, 3], done[0].stdout[-3000:]
    for r in range(4):
        t = tide[r]
        assert t["host"] == hosts.hostname(r // PER_HOST) and t["local_world_size"] == PER_HOST, t["host"]
        assert t["tide_env"] == [], t["tide_env"]  # nodes from the hosts alone
        assert t["num_nodes"] == 2 and t["engine"] == "gloo", (t["num_nodes"], t["engine"])
        stats = t["stats"]
        assert stats["zero_copy_all_gather"] > 0 and stats["stock_all_gather"] == 0, stats
        assert stats["zero_copy_reduce_scatter"] > 0 and stats["stock_reduce_scatter"] == 0, stats
        assert not t["warned"], t["warned"]
        assert t["inter_node_bytes"] > 0
        assert "all-gather: zero-copy on cpu, across 2 nodes: inter-node over gloo" in t["log"], t["log"]
        assert not t["names"] & (AG_COPIES | RS_COPIES)
        host_ranks = range(r // PER_HOST * PER_HOST, (r // PER_HOST + 1) * PER_HOST)
        assert t["dev_shm"] == [f"marker-of-rank-{q}" for q in host_ranks], t["dev_shm"]  # each host's own
    ref = run_ranks(_reference_train_worker, 4, PER_HOST, False, backend="gloo")
    assert tide[0]["losses"] == ref[0]["losses"]
    assert_params_equal(tide[0]["params"], ref[0]["params"], "tide on 2 hosts vs stock with the documented order")
    assert_memory_stays_in_nodes([tide[r]["inodes"] for r in range(4)], PER_HOST)


@pytest.mark.one_torch
@pytest.mark.parametrize("mode,pg_timeout", [("die", 20), ("hang", 8)])
def test_a_failed_host_is_a_dist_backend_error_on_every_survivor(tmp_path, mode, pg_timeout):
    """The second host's ranks are SIGKILLed ("die": their sockets close) or SIGSTOPped
    ("hang": alive and silent, their connections open) in the middle of a backward, TIDE-RS
    across the hosts in flight: both ranks of the first host raise DistBackendError naming
    the collective, at once for a dead host and after the group's timeout for a silent one.
    (The first host's torchrun is killed once its ranks have reported: its agent would wait
    out the elastic exit barrier, 300 s, for the other agent.)"""
    def survivors_reported(exit_codes):
        dead_host_done = exit_codes[1] is not None or mode == "hang"
        return dead_host_done and all((tmp_path / f"rank{r}.pkl").exists() for r in range(PER_HOST))

    done, results = torchrun_on_two_hosts(tmp_path, mode, {"PG_TIMEOUT_S": str(pg_timeout)},
                                          until=survivors_reported)
    if mode == "die":
        assert done[1].returncode not in (0, -9) and "SIGKILL" in done[1].stdout, \
            f"the dead host's torchrun exited {done[1].returncode}:\n{done[1].stdout[-3000:]}"
    assert sorted(results) == [0, 1], (sorted(results), done[0].stdout[-3000:])
    for r in (0, 1):
        error, elapsed = results[r]["error"], results[r]["elapsed"]
        assert error and error.startswith("DistBackendError") and "param_reduce_scatter" in error, \
            f"rank {r}: {error}"
        if mode == "die":
            assert elapsed < slack(5), f"rank {r} took {elapsed:.1f} s to notice a dead host"
        else:
            assert pg_timeout * 0.9 < elapsed < pg_timeout + slack(10), f"rank {r} took {elapsed:.1f} s"
