"""`ckpt`: inspect and convert checkpoints.

    python -m ragged_fsdp ckpt convert DIR OUT.pt [--key model]   DCP -> torch.save
    python -m ragged_fsdp ckpt convert IN.pt OUTDIR [--key model] torch.save -> DCP
    python -m ragged_fsdp ckpt convert IN.pt ROOT --root          ... published as a new step
    (an existing OUT.pt / OUTDIR checkpoint is replaced only with --force)
    python -m ragged_fsdp ckpt convert LOCALDIR OUT.pt [--key model] local save -> torch.save
    python -m ragged_fsdp ckpt ls ROOT                             published checkpoints, local saves
    python -m ragged_fsdp ckpt info DIR                            keys, shapes, dtypes, chunks

DIR may be a DCP directory, a root written by ``ragged_fsdp.checkpoint.save`` (its newest
published checkpoint is used) or a directory written by ``save_local``. No process group is
needed.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("ckpt", help="inspect and convert checkpoints (DCP <-> torch.save)",
                       description=__doc__.replace("`ckpt`: ", "", 1), formatter_class=argparse.RawDescriptionHelpFormatter)
    cmds = p.add_subparsers(dest="ckpt_command", metavar="ACTION")
    c = cmds.add_parser(
        "convert",
        help="DCP directory -> one torch.save file, or a torch.save file -> DCP directory",
        description="The direction follows SRC: a directory (DCP checkpoint or a root of "
        "published checkpoints) is written to the file DST with torch.save; a file is written "
        "to the directory DST as a DCP checkpoint.",
    )
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--key", default=None,
                   help="DCP->file: keep only this top-level entry (e.g. 'model'); "
                        "file->DCP: nest the file's state dict under this name")
    c.add_argument("--root", action="store_true",
                   help="file->DCP: DST is a root; publish the checkpoint atomically as a new step")
    c.add_argument("--step", type=int, default=None, help="with --root: the step to publish as")
    c.add_argument("--force", action="store_true",
                   help="replace DST if it exists (a file, or a DCP checkpoint directory); without it "
                        "an existing DST is an error")
    ls = cmds.add_parser("ls", help="list published checkpoints and local saves under a root")
    ls.add_argument("root")
    info = cmds.add_parser("info", help="keys, shapes, dtypes and chunk counts of a checkpoint")
    info.add_argument("path")
    p.set_defaults(_ckpt_parser=p)


def run(args) -> int:
    from ragged_fsdp import checkpoint as ck

    action = getattr(args, "ckpt_command", None)
    if action is None:
        args._ckpt_parser.print_help()
        return 0
    try:
        if action == "convert":
            return _convert(args, ck)
        if action == "ls":
            if not os.path.isdir(args.root):
                raise FileNotFoundError(f"checkpoint root {args.root} does not exist or is not a directory")
            found = ck.list_checkpoints(args.root)
            local = _local_saves(args.root)
            if not found and not local:
                print(f"no published checkpoint or local save under {args.root}")
                return 1
            for c in found:
                print(f"{c.step:>10}  {c.path}")
            for d in local:
                print(f"{'local':>10}  {d}  ({_local_state(d)})")
            return 0
        if action == "info":
            return _info(args.path, ck)
    except (OSError, KeyError, ValueError, ck.LocalCheckpointError) as e:  # incl. CheckpointCorruptError / MismatchError
        # one line naming the path and the problem; a traceback would bury it
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        if isinstance(e, OSError) and e.filename and str(e.filename) not in msg:
            msg = f"{e.filename}: {e.strerror or msg}"
        print(f"ckpt {action}: error: {' '.join(str(msg).split())}", file=sys.stderr)
        return 2
    raise AssertionError(action)


def _local_saves(root: str) -> list[str]:
    """``root`` itself if it is a local save, else its subdirectories that are, by name."""
    from ragged_fsdp.checkpoint.local_save import is_local_save

    if is_local_save(root):
        return [root]
    subs = sorted(os.path.join(root, n) for n in os.listdir(root) if not n.startswith("."))
    return [d for d in subs if os.path.isdir(d) and is_local_save(d)]


def _local_state(path: str) -> str:
    from ragged_fsdp.checkpoint.local_save import LocalCheckpointError, local_parts

    try:
        return f"local save, W = {local_parts(path)}, complete"
    except LocalCheckpointError as e:
        return f"local save, not loadable: {str(e).split(': ', 1)[-1]}"


def _convert(args, ck) -> int:
    from ragged_fsdp.checkpoint.local_save import is_local_save

    if os.path.isdir(args.src) and is_local_save(args.src):
        if args.root:
            raise ValueError(f"--root applies to a torch.save file -> DCP; {args.src} is a local save "
                             "(convert it to OUT.pt first, then OUT.pt to a root)")
        state = ck.local_to_torch_save(args.src, args.dst, key=args.key, force=args.force, progress=True)
        print(f"wrote {args.dst} ({_count(state)} tensors) from the local save {args.src}")
        return 0
    if os.path.isdir(args.src):
        src = ck.resolve(args.src)
        state = ck.dcp_to_torch_save(src, args.dst, key=args.key, force=args.force, progress=True)
        print(f"wrote {args.dst} ({_count(state)} tensors) from {src}")
        return 0
    if os.path.isfile(args.src):
        out = ck.torch_save_to_dcp(args.src, args.dst, key=args.key, root=args.root, step=args.step,
                                   force=args.force)
        print(f"wrote DCP checkpoint {out} from {args.src}")
        return 0
    raise FileNotFoundError(f"{args.src} does not exist")


def _count(obj) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(_count(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_count(v) for v in obj)
    return 0


def _info_local(path: str) -> int:
    from ragged_fsdp.checkpoint.local_save import describe_local

    d = describe_local(path)
    world, missing = d["world"], d["missing"]
    state = f"{world - len(missing)} of {world} parts" + (f", ranks {missing[:10]} missing: not loadable"
                                                          if missing else "")
    print(f"{path}: local save (save_local), save id {d['save_id']:016x}, {state}")
    total = 0
    for k in sorted(d["entries"]):
        e = d["entries"][k]
        if e["kind"] in ("ragged", "full"):
            n = 1
            for x in e["shape"]:
                n *= x
            total += n * getattr(__import__("torch"), e["dtype"].replace("torch.", "")).itemsize
            how = "sharded" if e["kind"] == "ragged" else "replicated"
            print(f"  {k}  {tuple(e['shape'])}  {e['dtype'].replace('torch.', '')}  {how}")
        elif e["kind"] == "rank":
            print(f"  {k}  (tensor, differs per rank)")
        else:
            print(f"  {k}  (object{', differs per rank' if e['kind'] == 'rank_object' else ''})")
    print(f"{len(d['entries'])} entries, {total / 2**20:.2f} MiB of tensors; every stored tensor has a CRC-32 and "
          "each .meta one over its bytes (checked by load_local and ckpt convert)")
    return 0


def _info(path, ck) -> int:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ragged_fsdp.checkpoint.local_save import is_local_save

    if os.path.isdir(path) and is_local_save(path):
        return _info_local(path)
    path = ck.resolve(path)
    md = ck.read_metadata(path)
    print(path)
    total = 0
    for k in sorted(md.state_dict_metadata):
        m = md.state_dict_metadata[k]
        if isinstance(m, TensorStorageMetadata):
            n = 1
            for s in m.size:
                n *= s
            total += n * m.properties.dtype.itemsize
            dtype = str(m.properties.dtype).replace("torch.", "")
            print(f"  {k}  {tuple(m.size)}  {dtype}  {len(m.chunks)} chunk(s)")
        else:
            print(f"  {k}  (object)")
    checked, items = ck.count_checksums(md)
    print(f"{len(md.state_dict_metadata)} entries, {total / 2**20:.2f} MiB of tensors, "
          f"{checked} of {items} stored items with a CRC-32")
    return 0
