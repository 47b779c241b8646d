"""Cluster hardware for the step-time model: presets with every constant's public source.

Units: bandwidths in GB/s (1e9 bytes per second), compute in TFLOP/s (1e12), latencies in
microseconds. "Line rate" constants are spec sheets; "achievable" constants come from
published measurements (named next to each) or from this project's own measurements
(facts.md), never from the TIDE paper's outcomes.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Hardware:
    name: str
    source: str
    # ---- one GPU
    sm_count: int
    hbm_GBps: float  # HBM peak (spec)
    hbm_copy_GBps: float  # achievable device-to-device copy, bytes read + bytes written
    bf16_peak_TFLOPs: float  # dense bf16 tensor-core peak (spec)
    gemm_bf16_TFLOPs: float  # achievable large bf16 GEMM rate
    attn_TFLOPs: float  # achievable flash-attention rate
    hbm_GiB: float
    # ---- one node
    gpus_per_node: int
    nvlink_GBps: float  # NVLink line rate per GPU, one direction
    nvlink_nccl_GBps: float  # NCCL bus bandwidth over NVLink (ring, AG / RS), per GPU
    nvlink_ce_GBps: float  # copy-engine / multimem transfers over NVLink, per GPU ingress
    nvlink_latency_us: float
    # ---- network
    nics_per_node: int
    nic_GBps: float  # line rate per NIC, one direction
    rdma_GBps: float  # achievable RDMA per NIC, one direction
    rdma_latency_us: float
    # ---- software constants (documented in docs/model.md)
    nccl_ctas: int = 16  # CTAs (SMs) a default NCCL AG / RS kernel holds
    gemm_tile: tuple = (128, 256)  # output tile of one CTA of a Hopper bf16 GEMM
    measured: dict = field(default_factory=dict)  # calibration keys that replaced presets

    def replace(self, **kw) -> "Hardware":
        return dataclasses.replace(self, **kw)


# H100 SXM5 80GB.
#  - 132 SMs, 3.35 TB/s HBM3, 80 GB, 989.4 TFLOP/s dense bf16 (1979 with sparsity),
#    NVLink4 900 GB/s bidirectional = 450 GB/s per direction:
#    NVIDIA H100 Tensor Core GPU datasheet and "NVIDIA H100 Tensor Core GPU Architecture"
#    whitepaper (GH100, SXM5 configuration: 132 SMs).
#  - 8 GPUs per HGX/DGX H100 node on 4 third-generation NVSwitch chips with NVLink SHARP
#    (multicast / multimem): DGX H100 user guide / NVSwitch whitepaper.
#  - 8x ConnectX-7 400 Gb/s (= 50 GB/s per direction) per DGX H100, one per GPU (rail).
#  - NCCL over NVLink4: "450GB/s is the line rate. With the protocol overhead (~20%) NCCL
#    can get an effective NVLink bandwidth of 370GB/s ... BusBw when running non-allreduce
#    operations" (S. Jeaugey, NCCL lead, NVIDIA/nccl-tests#212, 2024-05-06).
#  - NDR 400 Gb/s through NCCL: "you should see 46-48GB/s per NIC" (NVIDIA/nccl-tests#290,
#    NCCL maintainer, 2025-03-03). We use the low end, 46.
#  - Copy engines / multimem over NVLink: no measured figure of ours; we give them the same
#    effective 370 GB/s as NCCL (same wire, same packet overhead; CE transfers do not have
#    NCCL's flag/LL protocol overhead, so this is conservative). Calibrate with
#    allgather_ce_GBps.
#  - HBM copy: no measured H100 figure of ours; the spec peak 3.35 TB/s is used as an upper
#    bound for read+write copy traffic (calibrate with hbm_copy_GBps).
#  - GEMM: no measured H100 figure of ours; we scale the H200 measurement (790 of 989) to the
#    same fraction of peak, since H100 and H200 share the GH100 compute (same SMs, clocks).
#  - Flash attention: FlashAttention-3 (Shah et al., 2024) reports up to 740 TFLOP/s bf16/fp16
#    forward on H100 SXM5 (75% of peak); we use 0.75 x peak.
#  - Latencies: NVLink hop ~1 us, RDMA (IB NDR, one switch level + NIC + NCCL proxy) ~5 us:
#    order-of-magnitude figures; at the message sizes of FSDP units (hundreds of MB) they
#    change step times by < 0.1% (tests/python/test_model.py checks this).
H100 = Hardware(
    name="h100-sxm",
    source="NVIDIA H100 datasheet; NCCL maintainers' published figures (see hardware.py)",
    sm_count=132, hbm_GBps=3350.0, hbm_copy_GBps=3350.0,
    bf16_peak_TFLOPs=989.4, gemm_bf16_TFLOPs=790.0, attn_TFLOPs=0.75 * 989.4,
    hbm_GiB=80.0 * 1e9 / 2**30,
    gpus_per_node=8, nvlink_GBps=450.0, nvlink_nccl_GBps=370.0, nvlink_ce_GBps=370.0,
    nvlink_latency_us=1.0,
    nics_per_node=8, nic_GBps=50.0, rdma_GBps=46.0, rdma_latency_us=5.0,
)

# H200 SXM 141GB: same GH100 compute and NVLink4 as H100 SXM (NVIDIA H200 datasheet:
# 4.8 TB/s HBM3e, 141 GB, 989 TFLOP/s dense bf16, 900 GB/s NVLink), HGX H200 8-GPU boards.
H200 = H100.replace(
    name="h200-sxm",
    source="NVIDIA H200 datasheet (HBM3e 4.8 TB/s, 141 GB); rest as H100 SXM",
    hbm_GBps=4800.0, hbm_copy_GBps=4800.0, hbm_GiB=141.0 * 1e9 / 2**30,
)

# H200 with this project's measurements (shared/notes/facts.md, single-H200 test machine):
# about 4.3 TB/s device-to-device copy (bytes read + written), about 790 TFLOP/s bf16 GEMM on
# random data, 132 SMs. Network and NVLink as the H200 preset (no multi-GPU machine here).
H200_MEASURED = H200.replace(
    name="h200-measured",
    source="H200 datasheet + facts.md measurements (4.3 TB/s D2D copy, 790 TFLOP/s GEMM)",
    hbm_copy_GBps=4300.0, gemm_bf16_TFLOPs=790.0,
)

PRESETS = {hw.name: hw for hw in (H100, H200, H200_MEASURED)}
DEFAULT = "h200-measured"

# --calibrate: keys of the GPU script's results JSON -> Hardware fields. Values are GB/s or
# TFLOP/s per GPU, one direction for links.
CALIBRATION_KEYS = {
    "hbm_copy_GBps": "hbm_copy_GBps",
    "gemm_bf16_TFLOPs": "gemm_bf16_TFLOPs",
    "attn_TFLOPs": "attn_TFLOPs",
    "nvlink_GBps": "nvlink_nccl_GBps",  # measured NCCL AG/RS bus bandwidth inside a node
    "allgather_ce_GBps": "nvlink_ce_GBps",
    "rdma_GBps": "rdma_GBps",
    "rdma_latency_us": "rdma_latency_us",
    "sm_count": "sm_count",
    "nccl_ctas": "nccl_ctas",
    "gpus_per_node": "gpus_per_node",
    "nics_per_node": "nics_per_node",
}
# Keys the model reads but that are not Hardware fields (kernel rates of TIDE's own kernels).
EXTRA_KEYS = ("accumulate_GBps",)


def calibrate(hw: Hardware, results: dict) -> tuple[Hardware, dict]:
    """Replaces preset constants by measured ones. Returns (hardware, extras).

    `results` is the GPU script's JSON (any subset of CALIBRATION_KEYS / EXTRA_KEYS, plus
    free-form keys such as "device", which are kept in `measured` for the report). A
    top-level "results" or "calibration" object is also accepted.
    """
    for wrap in ("calibration", "results"):
        if isinstance(results.get(wrap), dict):
            results = {**results, **results[wrap]}
    kw, measured, extras = {}, {}, {}
    for key, fld in CALIBRATION_KEYS.items():
        if key in results and results[key] is not None:
            value = results[key]
            cur = getattr(hw, fld)
            kw[fld] = type(cur)(value)
            if not (kw[fld] > 0):
                raise ValueError(f"calibration value {key}={value!r} must be positive")
            measured[key] = kw[fld]
    for key in EXTRA_KEYS:
        if key in results and results[key] is not None:
            extras[key] = float(results[key])
            measured[key] = extras[key]
    unknown = sorted(k for k in results if k not in CALIBRATION_KEYS and k not in EXTRA_KEYS
                     and k not in ("device", "calibration", "results"))
    measured["ignored_keys"] = unknown
    name = hw.name + "+calibrated" + (f"({results['device']})" if results.get("device") else "")
    return hw.replace(name=name, measured=measured, **kw), extras


def load_calibration(path: str, hw: Hardware) -> tuple[Hardware, dict]:
    with open(path) as f:
        return calibrate(hw, json.load(f))
