"""python -m tide.doctor on this machine, checked against what the test process itself sees
(torch, the installed FSDP2 adapter, /dev/shm, the CUDA devices torch sees)."""
import json
import os
import subprocess
import sys

import torch

import tide

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.join(HERE, "..", "..", "python")


def doctor(*args, **env):
    environ = {**os.environ, "PYTHONPATH": PYTHON_DIR, **env}
    return subprocess.run([sys.executable, "-m", "tide.doctor", *args], capture_output=True, text=True,
                          env=environ, timeout=120)


def test_json_matches_what_this_process_sees():
    run = doctor("--json")
    r = json.loads(run.stdout)
    assert r["torch"] == torch.__version__
    assert r["fsdp2_adapter"] == tide.fsdp.generation() is not None
    st = os.statvfs("/dev/shm")
    assert r["dev_shm"]["bytes"] == st.f_blocks * st.f_frsize
    assert r["cpu"]["cores"] == os.cpu_count()
    assert r["tide_cuda"] == bool(tide._C.has_cuda)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert r["cuda_devices_seen_by_torch"] == gpus
    if tide._C.has_cuda:
        probe = r["cuda_probe"]
        assert probe["device_count"] == gpus
        assert gpus or probe["error"], "no device and no reason"
        assert len(probe["devices"]) == gpus
        # The one-sided calls TIDE looks up at run time, in the NCCL torch itself loaded.
        one_sided = r["nccl_one_sided"]
        nccl = torch.cuda.nccl.version()
        assert one_sided["version"] == ".".join(map(str, nccl)), (one_sided, nccl)
        if nccl >= (2, 29, 7):
            assert one_sided["usable"] and one_sided["missing"] == [], one_sided
            assert "one-sided puts into registered windows" in one_sided["between_nodes"]
        else:  # torch 2.11 ships NCCL 2.28.9: windows, no puts
            assert not one_sided["usable"] and "ncclPutSignal" in one_sided["missing"], one_sided
    # Zero-copy applies on this machine exactly when nothing made TIDE fall back.
    assert (run.returncode == 0) == (not r["fallbacks"]), (run.returncode, r["fallbacks"])
    if not gpus:
        assert run.returncode == 0 and "TIDE-AG" in r["paths"]["cpu"]["all_gather"]


def test_text_names_versions_seams_and_paths():
    run = doctor()
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert f"torch {torch.__version__}" in out
    assert f"the {tide.fsdp.generation()} adapter (zero-copy on)" in out
    assert "/dev/shm:" in out and "cpu all_gather: TIDE-AG" in out
    assert "zero-copy FSDP2 applies here" in out


def test_exit_status_says_when_tide_falls_back():
    run = doctor("--json", TIDE_FSDP="0")
    assert run.returncode == 1
    r = json.loads(run.stdout)
    assert r["fsdp2_adapter"] is None
    assert any("TIDE_FSDP=0" in why for why in r["fallbacks"])
    assert "stock FSDP2" in r["paths"]["cpu"]
    text = doctor(TIDE_FSDP="0")
    assert text.returncode == 1 and "TIDE would take FSDP2's stock path here" in text.stdout
