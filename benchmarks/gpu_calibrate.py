"""Calibrate a `simulate` profile on the lent GPU (part of the GPU check), in about a minute.

    PYTHONPATH=src python3 benchmarks/gpu_calibrate.py [--out out/sim/gpu_profile.json] [--peak-tflops X]
    PYTHONPATH=src python3 benchmarks/gpu_calibrate.py --device cpu --quick      # dry run, seconds
    python -m ragged_fsdp simulate --model llama3-8b --gpus 8 --gpu out/sim/gpu_profile.json

Measures GEMM efficiency by shape (bf16, Llama 3 8B / 70B projection sizes at 1k-16k tokens),
flash attention forward + backward at 2k and 8k tokens, a 1 GiB device copy and the host's
CPU cost per dispatched op (``ragged_fsdp.sim.calibrate_gpu``), then writes a profile whose
every number says where it came from. `simulate` prints such a profile's predictions without
a cross-validated band (the band is earned by the published-run fits, not by this profile).
"""

from __future__ import annotations

import argparse
import sys

import torch

from ragged_fsdp.sim.calibrate_gpu import calibrate_device


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/sim/gpu_profile.json")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="dense bf16 peak of this device (default: the matched data sheet)")
    ap.add_argument("--quick", action="store_true", help="fewer repeats and a small copy (dry runs)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_calibrate: no CUDA device; use --device cpu for a dry run", file=sys.stderr)
        return 2
    doc = calibrate_device(args.out, args.device, args.peak_tflops, args.quick)
    print(f"{doc['device']}: efficiency {doc['efficiency']:.3f} of {doc['flops'] / 1e12:.3g} TFLOP/s "
          f"({doc['sources']['efficiency']}); memory copy {doc['mem_bw'] / 1e12:.2f} TB/s; host "
          f"{doc['host_op_overhead_s'] * 1e6:.1f} us/op; {doc['seconds']} s")
    for g in doc["gemm"]:
        print(f"  gemm {g['m']:>6} x {g['n']:>6} x {g['k']:>6}: {g['flops_per_s'] / 1e12:8.3g} TFLOP/s "
              f"({g['flops_per_s'] / doc['flops']:.2f} of peak)")
    for a, r in zip(doc["attention"], doc["attention_over_gemm"]):
        print(f"  attention seq {a['seq']:>5} x {a['batch']}: {a['flops_per_s'] / 1e12:8.3g} TFLOP/s "
              f"({r:.2f} of the large-GEMM rate; the simulator's fitted ATTENTION_RATE is 0.485)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
