"""One process, no peers: MemTracker's transient (peak during the step minus live bytes after
it) of ragged_fsdp's Muon step alone, its AdamW groups alone, torch's single-tensor AdamW on
the same parameters, and one Newton-Schulz on the model's largest matrix (704 x 256), ours and
torch's (input, two Gram products, next iterate: what torchtitan's DistMuon holds).

    PYTHONPATH=src python benchmarks/muon_memory_probe.py
"""
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from ragged_fsdp.models.workloads import build
from ragged_fsdp.optim import Muon, muon_param_groups
from ragged_fsdp.optim.muon import DEFAULT_NS_COEFFICIENTS, _newton_schulz_


def transient(fn, *track) -> float:
    mt = MemTracker()
    if track:
        mt.track_external(*track)
    with mt:
        fn()
        peak = sum(d.get("Total", 0) for d in mt.get_tracker_snapshot("peak").values())
        after = sum(d.get("Total", 0) for d in mt.get_tracker_snapshot("current").values())
    return (peak - after) / 2**20


def main() -> None:
    torch.set_num_threads(1)
    m = build("dense", 64)
    for p in m.parameters():
        p.grad = torch.randn_like(p) * 0.01
    gs = muon_param_groups(m)
    for name, make in (("Muon, bounded (default wave_bytes)", lambda: Muon([dict(gs[0])], lr=0.02)),
                       ("Muon, one wave", lambda: Muon([dict(gs[0])], lr=0.02, wave_bytes=None)),
                       ("Muon's AdamW groups", lambda: Muon([dict(gs[1])])),
                       ("torch.optim.AdamW (single tensor)", lambda: torch.optim.AdamW([p for _, p in gs[1]["params"]]))):
        opt = make()
        opt.step()
        print(f"{name}: transient {transient(opt.step, m, opt):.2f} MiB")
    from torch.optim._muon import _zeropower_via_newtonschulz

    x = torch.randn(704, 256)
    print(f"one Newton-Schulz on 704 x 256, input included, ragged_fsdp's (each Gram product dropped once used): "
          f"{transient(lambda: _newton_schulz_(x.bfloat16(), DEFAULT_NS_COEFFICIENTS, 5, 1e-7)):.2f} MiB")
    print(f"one Newton-Schulz on 704 x 256, input included, torch.optim.Muon's (DistMuon's floor): "
          f"{transient(lambda: _zeropower_via_newtonschulz(x, DEFAULT_NS_COEFFICIENTS, 5, 1e-7)):.2f} MiB")


if __name__ == "__main__":
    main()
