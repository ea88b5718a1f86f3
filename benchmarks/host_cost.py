"""Where the host time of a training step goes, hook by hook, for ragged_fsdp and FSDP2::

    torchrun --nproc_per_node 2 benchmarks/host_cost.py --json out/host_cost_w2.json
    torchrun --nproc_per_node 1 benchmarks/host_cost.py --optim native
    torchrun --nproc_per_node 2 benchmarks/host_cost.py --model dense --optim native

A host-bound model (the ``deep`` workload: 48 Llama blocks of dim 64, vocab 512, batch 2 x 16,
each block and the root wrapped) trains with both frameworks in one launch, alternating
rounds. Each engine hook is wrapped before the models are built (hooks are bound when
``fully_shard`` registers them), and a step is split into phases:

* ``pre_forward``, ``post_forward``, ``pre_backward``: the module and tensor hooks;
* ``post_backward``: the per-parameter gradient hooks and the group's reduction;
* ``end_backward``: the autograd engine's final callback (waits, hand-out of gradients);
* ``optimizer``: ``step()`` and ``zero_grad()``;
* ``compute``: the rest (the model's own forward and backward, the loss).

A call inside another wrapped call counts in the outer one. Timing rounds measure process
CPU time per phase (gloo's waits block without spinning, so they are mostly not in it) and
wall time per step; a separate counting step reports per phase the Python function calls
(``sys.setprofile``), the aten ops dispatched (a ``TorchDispatchMode``: subclass ops and the
ops they run on local tensors both count), the new plain tensors those ops return, and the
DTensors constructed. Counting slows the step, so it is never timed. ``--optim``: ``torch``
(``torch.optim.AdamW`` with its default path for both: single-tensor on CPU, the path that
runs elementwise ops per parameter) or ``native`` (``ragged_fsdp.optim.AdamW`` against
``torch.optim.AdamW(foreach=True)``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ragged_fsdp.models.workloads import build

PHASES = ("pre_forward", "post_forward", "pre_backward", "post_backward", "end_backward", "optimizer", "compute")
FRAMEWORKS = ("ragged_fsdp", "fsdp2")


class Phases:
    """Per-phase CPU seconds and call counts of whatever runs inside the wrapped methods."""

    def __init__(self) -> None:
        self.depth = 0
        self.current = "compute"
        self.cpu: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.calls: dict[str, int] = dict.fromkeys(PHASES, 0)

    def reset(self) -> None:
        self.cpu = dict.fromkeys(PHASES, 0.0)
        self.calls = dict.fromkeys(PHASES, 0)

    def wrap(self, phase: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            self.current = phase
            self.calls[phase] += 1
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu[phase] += time.thread_time() - t0
                self.depth -= 1
                self.current = "compute"
        return timed


def _fsdp2_hooks():
    """(class, method name, phase) of torch 2.13's FSDP2 hooks (torch has no public probe)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as tpg
    from torch.distributed.fsdp._fully_shard import _fsdp_state as tst

    return [
        (tst.FSDPState, "_pre_forward", "pre_forward"),
        (tst.FSDPState, "_post_forward", "post_forward"),
        (tst.FSDPState, "_pre_backward", "pre_backward"),
        (tpg.FSDPParamGroup, "post_backward", "post_backward"),
        (tst.FSDPState, "_root_post_backward_final_callback", "end_backward"),
    ]


@contextlib.contextmanager
def instrumented(phases: Phases):
    """Wrap every hook of both frameworks for the duration (models built inside): ours through
    the engine's public probe (``ragged_fsdp.fsdp.probe``, whose points are these phases),
    FSDP2's by name."""
    from ragged_fsdp.fsdp import probe

    saved = []
    for cls, name, phase in _fsdp2_hooks():
        fn = cls.__dict__[name]
        saved.append((cls, name, fn))
        setattr(cls, name, phases.wrap(phase, fn))
    try:
        with probe(lambda phase, fn: phases.wrap(phase, fn)):
            yield
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)


def _build(framework: str, optim: str, model_kind: str):
    if framework == "ragged_fsdp":
        from ragged_fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    model = build(model_kind, 16 if model_kind == "deep" else 128)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    if optim == "native" and framework == "ragged_fsdp":
        from ragged_fsdp.optim import AdamW

        return model, AdamW(model.parameters(), lr=1e-3)
    foreach = True if optim == "native" else None
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)


class _Counter:
    """Python calls, aten ops, new plain tensors and DTensors built, by the phase they run in."""

    def __init__(self, phases: Phases) -> None:
        from torch.distributed.tensor import DTensor

        from ragged_fsdp.placement.dtensor import RaggedDTensor

        self.phases = phases
        self.py = dict.fromkeys(PHASES, 0)
        self.ops = dict.fromkeys(PHASES, 0)
        self.tensors = dict.fromkeys(PHASES, 0)
        self.dtensors = dict.fromkeys(PHASES, 0)
        inits = (DTensor.__init__, RaggedDTensor.__init__)
        self._init_codes = {getattr(f, "__wrapped__", f).__code__ for f in inits}

    def profile(self, frame, event, arg):
        if event == "call":
            phase = self.phases.current
            self.py[phase] += 1
            if frame.f_code in self._init_codes:
                self.dtensors[phase] += 1

    @contextlib.contextmanager
    def counting(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                phase = counter.phases.current
                counter.ops[phase] += 1
                schema = func._schema
                fresh = not any(r.alias_info is not None for r in schema.returns)
                if fresh:
                    outs = out if isinstance(out, (list, tuple)) else (out,)
                    counter.tensors[phase] += sum(type(o) is torch.Tensor for o in outs)
                return out

        sys.setprofile(self.profile)
        try:
            with Ops():
                yield
        finally:
            sys.setprofile(None)


def _run(args) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(100 + rank)
    vocab, shape = (512, (2, 16)) if args.model == "deep" else (2048, (4, 128))
    x = torch.randint(0, vocab, shape, generator=g)
    y = torch.randint(0, vocab, shape, generator=g)
    phases = Phases()
    runs = {}
    with instrumented(phases):
        for fw in FRAMEWORKS:
            model, opt = _build(fw, args.optim, args.model)
            step_opt = phases.wrap("optimizer", lambda opt=opt: (opt.step(), opt.zero_grad()))

            def step(model=model, step_opt=step_opt):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
                step_opt()

            runs[fw] = step
            blocks = len(model.layers) + 1
            for _ in range(2):
                step()
        wall = {fw: [] for fw in FRAMEWORKS}
        cpu = {fw: [] for fw in FRAMEWORKS}
        per_phase = {fw: {p: [] for p in PHASES} for fw in FRAMEWORKS}
        for r in range(args.rounds):
            for fw in (FRAMEWORKS if r % 2 == 0 else FRAMEWORKS[::-1]):
                dist.barrier()
                phases.reset()
                t0, c0 = time.perf_counter(), time.thread_time()
                for _ in range(args.steps):
                    runs[fw]()
                w, c = (time.perf_counter() - t0) / args.steps, (time.thread_time() - c0) / args.steps
                wall[fw].append(w)
                cpu[fw].append(c)
                hooked = 0.0
                for p in PHASES[:-1]:
                    per_phase[fw][p].append(phases.cpu[p] / args.steps)
                    hooked += phases.cpu[p] / args.steps
                per_phase[fw]["compute"].append(c - hooked)
        counts = {}
        for fw in FRAMEWORKS:
            dist.barrier()
            phases.reset()
            counter = _Counter(phases)
            with counter.counting():
                runs[fw]()
            counts[fw] = {"hook_calls": dict(phases.calls), "python_calls": counter.py, "aten_ops": counter.ops,
                          "new_tensors": counter.tensors, "dtensors_built": counter.dtensors}
    med = statistics.median
    per_block = 1e3 / blocks
    rows = [{"phase": p, "framework": fw, "cpu_ms": 1e3 * med(per_phase[fw][p]),
             "us_per_block": 1e3 * per_block * med(per_phase[fw][p]),
             "hook_calls": counts[fw]["hook_calls"][p] if p != "compute" else "-",
             **{k: counts[fw][k][p] for k in ("python_calls", "aten_ops", "new_tensors", "dtensors_built")}}
            for p in PHASES for fw in FRAMEWORKS]
    return {
        "rows": rows,
        "world": world, "model": args.model, "optim": args.optim, "blocks": blocks, "rounds": args.rounds, "steps": args.steps,
        "wall_ratio": med(a / b for a, b in zip(wall["ragged_fsdp"], wall["fsdp2"])),
        "cpu_ratio": med(a / b for a, b in zip(cpu["ragged_fsdp"], cpu["fsdp2"])),
        "cpu_ms": {fw: {p: 1e3 * med(v) for p, v in per_phase[fw].items()} for fw in FRAMEWORKS},
        "step_cpu_ms": {fw: 1e3 * med(cpu[fw]) for fw in FRAMEWORKS},
        "counts": counts,
    }


def render(res: dict) -> str:
    blocks = res["blocks"]
    lines = [
        f"W={res['world']}, model {res['model']} ({res['blocks'] - 1} blocks + root), optimizer: {res['optim']}; "
        f"{res['rounds']} rounds x {res['steps']} steps, medians; rank 0",
        f"step, ragged_fsdp / FSDP2: wall {res['wall_ratio']:.3f}, process CPU {res['cpu_ratio']:.3f}",
        "",
        "phase          framework    CPU ms/step  us/block  hook calls  Python calls  aten ops  new tensors  DTensors built",
    ]
    for p in PHASES:
        for fw in FRAMEWORKS:
            c = res["counts"][fw]
            ms = res["cpu_ms"][fw][p]
            calls = c["hook_calls"][p] if p != "compute" else "-"
            lines.append(f"{p:<14} {fw:<12} {ms:>11.2f}  {1e3 * ms / blocks:>8.1f}  {calls!s:>10}  "
                         f"{c['python_calls'][p]:>12,}  {c['aten_ops'][p]:>8,}  {c['new_tensors'][p]:>11,}  "
                         f"{c['dtensors_built'][p]:>14,}")
    for fw in FRAMEWORKS:
        lines.append(f"{'step':<14} {fw:<12} {res['step_cpu_ms'][fw]:>11.2f}")
    return "\n".join(lines)


def _at_least_one(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: must be at least 1")
    return n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--optim", choices=("torch", "native"), default="torch")
    ap.add_argument("--model", choices=("deep", "dense", "moe"), default="deep",
                    help="deep: the host-bound model above; dense, moe: the bench's workloads (batch 4 x 128)")
    ap.add_argument("--rounds", type=_at_least_one, default=8)
    ap.add_argument("--steps", type=_at_least_one, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:
        ap.error("run under torchrun, e.g. torchrun --nproc_per_node 2 benchmarks/host_cost.py")
    dist.init_process_group("gloo")
    try:
        res = _run(args)
        if dist.get_rank() == 0:
            print(render(res))
            if args.json:
                from ragged_fsdp.bench.meta import run_meta

                res["meta"] = run_meta(f"torchrun --nproc_per_node {dist.get_world_size()} benchmarks/host_cost.py "
                                       + " ".join(sys.argv[1:]))
                os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
                with open(args.json, "w") as f:
                    json.dump(res, f, indent=1)
                print(f"wrote {args.json}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
