"""Separate hosts on one machine, for the tests that launch `torchrun --nnodes N` as users do.

Each host is a process tree in network, UTS, mount and PID namespaces of its own: its own
hostname (`tide-host<i>`, resolved through its own /etc/hosts, as a cluster's DNS would), its
own network stack and abstract Unix sockets, its own empty /dev/shm and its own processes.
The hosts reach each other over TCP through a bridge in host 0's namespace (hosts on one
switch); they share only the file system (where the tests collect results), so no shared
memory, socket or process of one is visible to the other. No namespace has a name, and each
host's first process is its PID namespace's init: when it dies (killed at the deadline, or
with the test), the kernel kills everything in the host, torchrun's workers in their own
sessions and stopped ones included. Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN), `unshare`,
`nsenter` and `ip` (iproute2); `why_no_hosts()` says what is missing.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

SUBNET = "10.88.0"


def address(i: int) -> str:
    return f"{SUBNET}.{i + 1}"


def hostname(i: int) -> str:
    return f"tide-host{i}"


def why_no_hosts() -> str:
    """Why hosts cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "separate hosts need root (network, UTS and mount namespaces)"
    for tool in ("unshare", "nsenter", "ip"):
        if not shutil.which(tool):
            return f"separate hosts need `{tool}` (util-linux / iproute2)"
    probe = subprocess.run(UNSHARE + ["ip", "link", "add", "br0", "type", "bridge"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"network namespaces with a bridge cannot be made here: {probe.stderr.strip()}"
    return ""


UNSHARE = ["unshare", "--net", "--uts", "--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc",
           "--kill-child"]

# Runs as a host's init, inside its new namespaces: the host's name, /etc/hosts and /dev/shm,
# then (once the parent wired the link, within 60 s) its address, then the command, as a
# child: an init that exec'd it would not reap the orphans of a torchrun.
_HOST_INIT = r"""
set -eu
i=$1 dir=$2 dev=$3 addr=$4; shift 4
hostname "tide-host$i"
mount -t tmpfs -o size=2g tmpfs /dev/shm
mount --bind "$dir/hosts" /etc/hosts
touch "$dir/ready$i"
for _ in $(seq 3000); do [ -e "$dir/wired" ] && break; sleep 0.02; done
[ -e "$dir/wired" ] || { echo "host $i: never wired" >&2; exit 1; }
ip link set lo up
ip addr add "$addr/24" dev "$dev"
ip link set "$dev" up
"$@" &
wait $!
"""


def run_on_hosts(commands, env=None, timeout=300.0, until=None):
    """Runs commands[i] on host i (all at once) and returns their CompletedProcess objects
    (stdout and stderr merged), in host order. A host still running at `timeout` seconds, or
    once `until(exit_codes)` returns true (polled with each host's exit code so far, None while
    it runs), is killed with everything in it; its returncode is
    then -9."""
    n = len(commands)
    with tempfile.TemporaryDirectory(prefix="tide-hosts-") as d:
        with open(os.path.join(d, "hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n")
            f.writelines(f"{address(i)} {hostname(i)}\n" for i in range(n))
        procs, logs = [], []
        try:
            for i, cmd in enumerate(commands):
                log = open(os.path.join(d, f"log{i}"), "w+")
                logs.append(log)
                dev = "br0" if i == 0 else "eth0"
                procs.append(subprocess.Popen(
                    UNSHARE + ["bash", "-c", _HOST_INIT, "host-init", str(i), d, dev, address(i), *cmd],
                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
            pids = [_await_init(d, i, procs[i]) for i in range(n)]
            _wire(pids)
            open(os.path.join(d, "wired"), "w").close()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                if until is not None and until([p.poll() for p in procs]):
                    break
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        results = []
        for i, (p, log) in enumerate(zip(procs, logs)):
            log.seek(0)
            results.append(subprocess.CompletedProcess(commands[i], p.returncode, log.read(), ""))
            log.close()
        return results


def _await_init(d, i, proc, timeout=30.0):
    """The pid (here) of host i's init, unshare's child, once it is in its namespaces."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(d, f"ready{i}")):
        if proc.poll() is not None or time.monotonic() > deadline:
            with open(os.path.join(d, f"log{i}")) as f:
                raise RuntimeError(f"host {i} did not start (exit {proc.poll()}): {f.read()}")
        time.sleep(0.02)
    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
        return int(f.read().split()[0])


def _wire(pids):
    """A bridge br0 in host 0's namespace and a veth pair from it to each other host's eth0."""
    def in_host0(*args):
        done = subprocess.run(["nsenter", f"--net=/proc/{pids[0]}/ns/net", "ip", *args], capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)} in host 0: {done.stderr.strip()}")

    in_host0("link", "add", "br0", "type", "bridge")
    for i, pid in enumerate(pids[1:], start=1):
        in_host0("link", "add", f"port{i}", "type", "veth", "peer", "name", "eth0", "netns", str(pid))
        in_host0("link", "set", f"port{i}", "master", "br0")
        in_host0("link", "set", f"port{i}", "up")
