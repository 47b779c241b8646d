"""python -m tide.doctor [--json]: what TIDE will do on this machine, and why.

Torch and its CUDA / NCCL versions, whether this torch's FSDP2 seams are known (zero-copy on
or off, and why), /dev/shm, the CPU, and on a GPU node what the probe finds (peer access, VMM
with POSIX fds, multicast, stream memory operations, copy engines) and which path each
collective takes. Plain text, or JSON with --json. Exit status 1 when TIDE would take
FSDP2's stock path on this machine (the reasons are listed), else 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import tide
from tide import _C, fsdp


def _nccl_version():
    try:
        return ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # a CPU-only torch
        return None


def _nccl_one_sided():
    """Whether the loaded NCCL has the one-sided calls TIDE-AG puts between nodes with (its
    own dlsym lookup); whether a communicator supports them is known only on the nodes."""
    got = _C.nccl_one_sided()
    v = got["version"]
    version = f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v else None
    usable = bool(v) and v >= 22907 and not got["missing"]
    if usable:
        between = (f"NCCL {version}'s one-sided puts into registered windows where every rank's communicator "
                   "has host RMA (TIDE_NCCL_ONE_SIDED), else NCCL send/recv")
    else:
        why = (f"NCCL {version} is older than 2.29.7" if v and v < 22907 else
               f"NCCL {version} lacks {', '.join(got['missing'])}" if v else "no NCCL loaded")
        between = f"NCCL send/recv ({why}: no one-sided puts)"
    return {"version": version, "missing": got["missing"], "usable": usable, "between_nodes": between}


def _dev_shm():
    try:
        st = os.statvfs("/dev/shm")
        return {"bytes": st.f_blocks * st.f_frsize, "free": st.f_bavail * st.f_frsize}
    except OSError as e:
        return {"error": str(e)}


def _fsdp_seams():
    if os.environ.get("TIDE_FSDP", "1") == "0":
        return None, ["TIDE_FSDP=0 switches zero-copy FSDP2 off"]
    generation = fsdp.generation()
    if generation is not None:
        return generation, []
    changed = {a.NAME: fsdp._mismatches(a) for a in fsdp._GENERATIONS}
    closest = min(changed, key=lambda name: len(changed[name]))
    return None, [f"torch {torch.__version__} changed FSDP2's {changed[closest]} (closest known: the "
                  f"{closest} generation): FSDP2 runs its stock path over the tide backend"]


def report() -> dict:
    """Everything the doctor knows, as plain data; `fallbacks` lists why TIDE would take
    FSDP2's stock path here (empty: zero-copy applies)."""
    fallbacks: list[str] = []
    generation, why_not = _fsdp_seams()
    fallbacks += why_not
    r = {
        "tide": tide.__version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nccl": _nccl_version(),
        "python": sys.version.split()[0],
        "cpu": {"capability": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count()},
        "dev_shm": _dev_shm(),
        "fsdp2_adapter": generation,
        "tide_cuda": bool(_C.has_cuda),
    }
    if generation:
        paths = {"cpu": {
            "all_gather": "TIDE-AG into each parameter's storage over host shared memory (memfds; "
                          "across nodes: gloo between them)",
            "reduce_scatter": "TIDE-RS into fp32 shards through bounded staging (across nodes: fp32 "
                              "partials over gloo)",
        }}
    else:
        paths = {"cpu": "stock FSDP2 over the tide backend (FSDP2's seams not taken)"}
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    r["cuda_devices_seen_by_torch"] = gpus
    if _C.has_cuda:
        caps = _C.cuda_capabilities(max(gpus, 2))  # one GPU: ranks as processes sharing it
        r["cuda_probe"] = caps
        r["nccl_one_sided"] = _nccl_one_sided()
        if not generation:
            paths["cuda"] = "stock FSDP2 over NCCL (FSDP2's seams not taken)"
        elif caps["allgather_path"] == "copy engines":
            paths["cuda"] = {
                "all_gather": f"TIDE-AG on copy engines ({caps['allgather_reason']}): no kernel at "
                              "equal dtypes, one cast kernel per parameter where the storage dtype "
                              "differs; across nodes: " + r["nccl_one_sided"]["between_nodes"],
                "reduce_scatter": "TIDE-RS: copy-engine staging + few-CTA fp32 accumulation; across "
                                  "nodes: node partials (fp32; the gradient dtype at one "
                                  "GPU per node) over NCCL",
            }
        else:
            paths["cuda"] = f"stock FSDP2 over NCCL ({caps['allgather_reason']})"
            if gpus:
                fallbacks.append(f"CUDA: {caps['allgather_reason']}")
    else:
        paths["cuda"] = "stock FSDP2 over NCCL (tide was built without its CUDA path)"
        if gpus:
            fallbacks.append("CUDA: tide was built without its CUDA path")
    r["paths"] = paths
    r["fallbacks"] = fallbacks
    return r


def _text(r: dict) -> str:
    lines = [f"tide {r['tide']} on torch {r['torch']} (CUDA {r['torch_cuda']}, NCCL {r['nccl']}), "
             f"python {r['python']}",
             f"CPU: {r['cpu']['cores']} cores, capability {r['cpu']['capability']}"]
    shm = r["dev_shm"]
    lines.append(f"/dev/shm: {shm['bytes'] / 2**30:.1f} GiB, {shm['free'] / 2**30:.1f} GiB free (TIDE's "
                 "host memory is memfds: it needs memory, not /dev/shm)" if "bytes" in shm
                 else f"/dev/shm: {shm['error']}")
    lines.append(f"FSDP2 seams: {'known, the ' + r['fsdp2_adapter'] + ' adapter (zero-copy on)' if r['fsdp2_adapter'] else 'not known (zero-copy off)'}")
    probe = r.get("cuda_probe")
    if probe is None:
        lines.append("CUDA: tide was built without its CUDA path")
    elif not probe["device_count"]:
        lines.append(f"CUDA: no device ({probe['error']}); runtime {probe['runtime_version']}, "
                     f"NCCL {probe['nccl_version']}")
    else:
        lines.append(f"CUDA: driver {probe['driver_version']}, runtime {probe['runtime_version']}, "
                     f"NCCL {probe['nccl_version']}, {probe['device_count']} device(s)")
        for d in probe["devices"]:
            lines.append(f"  cuda:{d['ordinal']} {d['name']} (sm_{d['compute_capability'].replace('.', '')}, "
                         f"{d['sm_count']} SMs, {d['total_memory'] / 2**30:.0f} GiB): copy engines "
                         f"{d['copy_engines']}, VMM+POSIX fds {d['vmm_posix_fd']}, multicast "
                         f"{d['multicast']}, IPC {d['ipc']}, stream memory ops {d['stream_mem_ops']}")
        lines.append(f"  peer access: {probe['peer_access']}")
    if "nccl_one_sided" in r:
        lines.append(f"  TIDE-AG between GPU nodes: {r['nccl_one_sided']['between_nodes']}")
    lines.append("paths:")
    for device, what in r["paths"].items():
        if isinstance(what, dict):
            for collective, how in what.items():
                lines.append(f"  {device} {collective}: {how}")
        else:
            lines.append(f"  {device}: {what}")
    if r["fallbacks"]:
        lines.append("TIDE would take FSDP2's stock path here:")
        lines += [f"  - {why}" for why in r["fallbacks"]]
    else:
        lines.append("zero-copy FSDP2 applies here")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tide.doctor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = ap.parse_args(argv)
    r = report()
    print(json.dumps(r, indent=2) if args.json else _text(r))
    return 1 if r["fallbacks"] else 0


if __name__ == "__main__":
    sys.exit(main())
