"""Run ``plan --suggest`` recipes on tiny Hugging Face models, in a process of its own.

Reads a JSON list of cases on stdin: ``{"hf": <config dict>, "model_type": ..., "world": W,
"ep": E, "recipe": <code>}``. Starts a fake process group of ``W`` ranks (no communication:
only shapes matter), builds the model, keeps the first ``1/E`` of every MoE block's experts
(what expert parallelism leaves on EP rank 0), and executes the recipe with the real
``init_device_mesh`` and ``parallelize_module`` but a ``fully_shard`` that records, for each
call, the parameters it takes (TP-local shapes: what FSDP would shard) and the mesh it gets.
Prints one JSON list of recorded calls per case. With ``"real": true`` the recipe runs with
torch's own ``fully_shard`` instead (FSDP2 accepts every call as written) and the case reports,
per parameter, the mesh FSDP2 left it on.
"""

import json
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

warnings.filterwarnings("ignore")


def _build(case):
    import transformers

    cfg = transformers.AutoConfig.for_model(case["model_type"], **case["hf"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    ep = case["ep"]
    if ep > 1:
        for block in model.model.layers:
            experts = getattr(block.mlp, "experts", None)
            if isinstance(experts, nn.ModuleList):
                block.mlp.experts = nn.ModuleList(list(experts)[: len(experts) // ep])
    return model


def _run_real(case, env, code):
    from torch.distributed.fsdp import fully_shard

    model = env["model"]
    exec(compile(code, "<recipe>", "exec"), dict(env, fully_shard=fully_shard))
    if case["ep"] == 1:  # a step runs (values are meaningless on a fake group; layouts must fit)
        ids = torch.randint(0, model.config.vocab_size, (2, 5))
        model(input_ids=ids, labels=ids).loss.backward()
        assert all(p.grad is not None for p in model.parameters())
    return {n: {"mesh_shape": list(p.device_mesh.shape), "dim_names": list(p.device_mesh.mesh_dim_names)}
            for n, p in model.named_parameters()}


def _run(case):
    model = _build(case)
    claimed, calls = set(), []

    def fully_shard(module, mesh):
        names = {id(p): n for n, p in model.named_parameters()}  # after TP: DTensor parameters
        mods = module if isinstance(module, list) else [module]
        params = {}
        for mod in mods:
            for p in mod.parameters():
                if id(p) in claimed:
                    continue
                claimed.add(id(p))
                local = p.to_local() if hasattr(p, "to_local") else p
                params[names[id(p)]] = list(local.shape)
        call = {"params": params, "mesh_shape": list(mesh.shape), "mesh_dim_names": list(mesh.mesh_dim_names),
                "divide_factor": None}

        def set_gradient_divide_factor(f, call=call):
            call["divide_factor"] = f

        for mod in mods:
            mod.set_gradient_divide_factor = set_gradient_divide_factor
        calls.append(call)
        return module

    code = "\n".join(line for line in case["recipe"].splitlines()
                     if not line.startswith(("from ", "import ")))
    code = code.replace('init_device_mesh("cuda"', 'init_device_mesh("cpu"')
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    env = dict(model=model, fully_shard=fully_shard, init_device_mesh=init_device_mesh, Replicate=Replicate,
               ColwiseParallel=ColwiseParallel, RowwiseParallel=RowwiseParallel,
               parallelize_module=parallelize_module)
    if case.get("real"):
        return _run_real(case, env, code)
    exec(compile(code, "<recipe>", "exec"), env)
    return calls


def main():
    cases = json.load(sys.stdin)
    out, world = [], None
    for case in cases:
        if case["world"] != world:
            if world is not None:
                dist.destroy_process_group()
            world = case["world"]
            dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
        out.append(_run(case))
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
