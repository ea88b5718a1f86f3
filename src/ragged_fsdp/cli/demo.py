"""`demo`: train the reference model on 2 CPU ranks (torchrun) with ragged_fsdp and FSDP2."""

from __future__ import annotations

import os
import subprocess
import sys

from ._args import UsageError, output_dir


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="train on CPU ranks with ragged_fsdp, then FSDP2; compare")
    p.add_argument("--nproc", type=int, default=2, help="CPU ranks (default 2)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16, help="global batch in sequences, a multiple of --nproc (default 16)")
    p.add_argument("--data", default=None, help="any text file of at least 1 KiB (default: the embedded corpus)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adamw8bit", "muon", "shampoo"])
    p.add_argument("--out", default="out/demo", help="directory for the report (default out/demo)")


def check(args) -> str | None:
    """Why the demo cannot run with these arguments, or None. Every argument is checked here,
    before torchrun starts N processes that would each fail the same way (a missing --data
    file used to fail in every rank a minute in; a bad --out only after the training)."""
    from ..train import check_args, check_data

    err = check_args(args.steps, args.batch, args.nproc) or check_data(args.data)
    if err:
        return err
    try:
        output_dir("--out", args.out)
    except UsageError as e:
        return str(e)
    return None


def run(args) -> int:
    err = check(args)
    if err:
        print(f"demo: error: {err}", file=sys.stderr)
        return 2
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
        "-m", "ragged_fsdp.train", "--steps", str(args.steps), "--batch", str(args.batch),
        "--optimizer", args.optimizer, "--out", args.out,
    ]
    if args.data:
        cmd += ["--data", args.data]
    env_note = "OMP_NUM_THREADS=1"
    print(f"$ {env_note} torchrun --standalone --nproc_per_node={args.nproc} -m ragged_fsdp.train ...", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.call(cmd, env=env)
