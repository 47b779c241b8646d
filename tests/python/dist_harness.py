"""Runs a function on N rank processes, with a process group per rank, and collects results.

Ranks start from a fork server that has imported torch once (a spawned rank spends about
1.5 s of CPU importing torch, and the suite starts ranks by the hundred on 2 cores); each
rank takes the parent's environment as it is at the call (monkeypatched TIDE_* variables
included) before it imports tide, so nothing of tide is inherited from the server. Each
rank then calls init_process_group(backend, ...) over a FileStore in a fresh temp dir, runs
fn(rank, world_size, *args) and sends back its return value or traceback.
The parent fails on any rank's exception and kills every rank that outlives `timeout`
times TIDE_TEST_TIME_SCALE (default 3): the deadline only tells a hang from a slow run,
and a machine shared with other work is slow. A hung rank's Python and native stacks are
printed before it is killed (faulthandler; gdb where the machine has it), and a rank that
dies without reporting (a crash) fails the run at once with its exit status.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import tempfile
import traceback
from datetime import timedelta

TIME_SCALE = float(os.environ.get("TIDE_TEST_TIME_SCALE") or 3.0)


# What the fork server imports once for every rank it forks: torch, dynamo and the
# transformers models of real_models.py (about 4 s a rank otherwise, 2 cores shared). Not
# tide: it reads its environment when imported (TIDE_FSDP), so each rank imports it after
# taking the caller's environment.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch._dynamo",
           "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2"]


def slack(seconds: float) -> float:
    """A test's allowance for a slow machine (`seconds` on an idle one), scaled."""
    return seconds * TIME_SCALE


def _rank_main(fn, rank, world_size, init_file, backend, pg_timeout_s, args, kwargs, queue,
               environ, before_init=None, stacks_file=None):
    import faulthandler

    # A crash writes its Python stack to stacks_file, and so does SIGUSR1, which the parent
    # sends a hung rank (dump_stacks). A file, not stderr: a fork server's child writes to the
    # server's stderr, which pytest does not capture for the test at hand.
    stacks = open(stacks_file, "w")  # noqa: SIM115  faulthandler writes to it until exit
    faulthandler.enable(stacks, all_threads=True)
    faulthandler.register(signal.SIGUSR1, stacks, all_threads=True)
    try:
        os.environ.clear()
        os.environ.update(environ)
        if before_init is not None:
            before_init(rank)
        os.environ.setdefault("USE_LIBUV", "0")
        import torch.distributed as dist

        import tide  # noqa: F401  registers the backend

        if backend is not None:
            dist.init_process_group(
                backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                timeout=timedelta(seconds=pg_timeout_s),
            )
        result = fn(rank, world_size, *args, **kwargs)
        if backend is not None and dist.is_initialized():  # a test may have aborted it
            dist.destroy_process_group()
        # Plain pickle: tensors travel by value, not as shared-memory handles that die
        # with this process.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001  every failure goes back to the parent
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(fn, world_size, *args, backend="tide", timeout=120, pg_timeout_s=60,
              expect_exit=None, kwargs=None, before_init=None):
    """Runs fn(rank, world_size, *args, **kwargs) on every rank and returns
    [result of rank 0, ..., rank N-1]; raises AssertionError naming failed ranks.

    expect_exit: ranks that are expected to die (they report nothing).
    before_init: a module-level function run as before_init(rank) in each rank before the
    process group exists.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    queue = ctx.Queue()
    expect_exit = set(expect_exit or ())
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank_main, daemon=True,
                        args=(fn, r, world_size, init_file, backend, pg_timeout_s, args,
                              kwargs or {}, queue, dict(os.environ), before_init,
                              stacks_file(tmp, r)))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results, errors = {}, {}
        import queue as queue_mod
        import time

        timeout = slack(timeout)
        deadline = time.monotonic() + timeout
        want = world_size - len(expect_exit)
        dead_since = {}  # rank -> when it was first seen gone without a report
        crashed = {}  # rank -> exit status
        while len(results) + len(errors) + len(crashed) < want and time.monotonic() < deadline:
            try:
                rank, ok, value = queue.get(timeout=0.5)
                (results if ok else errors)[rank] = value
                continue
            except queue_mod.Empty:
                pass
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r in results or r in errors or r in expect_exit or r in crashed or p.is_alive():
                    continue
                # Its report may still be in the pipe: gone for 2 s without one is a crash.
                if now - dead_since.setdefault(r, now) > 2.0:
                    crashed[r] = p.exitcode
        missing = [r for r in range(world_size) if r not in results and r not in errors
                   and r not in expect_exit and r not in crashed]
        native = dump_stacks({r: procs[r].pid for r in missing if procs[r].is_alive()}) if missing else {}
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        if errors or missing or crashed:
            msg = [f"rank {r} failed:\n{tb}" for r, tb in sorted(errors.items())]
            msg += [f"rank {r} died without reporting: {exit_status(code)}\n{read_stacks(tmp, r)}"
                    for r, code in sorted(crashed.items())]
            if missing:
                msg.append(f"ranks {missing} did not finish within {timeout:.0f} s "
                           f"(TIDE_TEST_TIME_SCALE={TIME_SCALE:g}); their stacks:")
                msg += [f"rank {r}:\n{read_stacks(tmp, r)}{native.get(r, '')}" for r in missing]
            raise AssertionError("\n".join(msg))
        return [pickle.loads(results[r]) if r in results else None for r in range(world_size)]


def exit_status(code):
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def stacks_file(tmp, rank):
    return os.path.join(tmp, f"stacks-{rank}.txt")


def read_stacks(tmp, rank):
    try:
        with open(stacks_file(tmp, rank)) as f:
            return f.read() or "(no Python stack written)\n"
    except OSError as e:
        return f"(no Python stack: {e})\n"


def dump_stacks(pids):
    """Asks the hung ranks `pids` (rank -> pid) for their Python stacks (SIGUSR1, written to
    their stacks_file) and returns each one's native stacks of every thread (gdb, where the
    machine has it), by rank."""
    import shutil
    import time

    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(1.0)  # faulthandler writes from the signal handler of a busy process
    gdb = shutil.which("gdb")
    native = {}
    for rank, pid in sorted(pids.items()):
        if not gdb:
            native[rank] = "(no gdb on this machine for the native stacks)\n"
            continue
        try:
            run = subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-iex", "set auto-load off",
                                  "-ex", "thread apply all bt"],
                                 capture_output=True, text=True, timeout=60)
            native[rank] = f"native stacks (gdb):\n{run.stdout or run.stderr[-2000:]}"
        except subprocess.TimeoutExpired:
            native[rank] = "(gdb did not finish in 60 s)\n"
    return native
