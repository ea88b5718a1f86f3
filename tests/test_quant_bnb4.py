"""QLoRA as Hugging Face users run it: a tiny Llama saved with ``save_pretrained``, loaded 4-bit
with ``BitsAndBytesConfig`` (NF4, fp32 or bf16 quant storage, double quantisation on or off),
LoRA on every linear through peft, sharded with ``fully_shard``; against the same model in
one process, and the same cases under torch's ``fully_shard`` (recorded, see
docs/quantized-weights.md).

One launch of 3 gloo ranks; sub-meshes give W = 1, 2 (ranks 0, 1) and 3. The base checkpoints
are written by the pytest process before the launch (``BNB4_BASE``, ``BNB4_BASE2``: another
seed, so its statistics differ). ``RAGGED_BNB4_RECORD=<file>`` makes rank 0 append one JSON
line per comparison (what the docs' table is rendered from).

Bounds: losses and adapters agree within float rounding, not bitwise: the reduce averages the
ranks' fp32 gradients ((g0 + g1) / 2 is not the one-process sum of the same terms in the same
order). Everything a checkpoint or a gather copies is compared with ``torch.equal``.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from _dist import check_case, run_cases

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
pytest.importorskip("transformers")

WORLD = 3
VOCAB = 128


def _save_base(path: str, seed: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    # q/o 128 x 128, k/v 64 x 128, mlp 192 x 128 and 128 x 192: under double quantisation the
    # sharding unit is 64 x 256 values (k/v: half a unit, mlp: 1.5), without it 64 values
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(path)


def _groups(rank):
    from torch.distributed.device_mesh import DeviceMesh

    solo = [dist.new_group([r]) for r in range(WORLD)]
    pair = dist.new_group([0, 1])
    out = {1: (solo[rank], DeviceMesh.from_group(solo[rank], "cpu"))}
    out[2] = (pair, DeviceMesh.from_group(pair, "cpu")) if rank < 2 else (None, None)
    out[3] = (dist.group.WORLD, DeviceMesh("cpu", torch.arange(WORLD)))
    return out


def _load(storage=torch.bfloat16, dq=True, base="BNB4_BASE", lora_seed=1):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_quant_storage=storage,
                           bnb_4bit_use_double_quant=dq, bnb_4bit_compute_dtype=torch.float32)
    m = AutoModelForCausalLM.from_pretrained(os.environ[base], quantization_config=q, dtype=torch.float32)
    torch.manual_seed(lora_seed)  # gaussian lora_B: the adapters change the loss from the first step
    model = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                         init_lora_weights="gaussian"))
    return model.train()  # from_pretrained returns the model in eval mode


def _linears4(model):
    import bitsandbytes as bnb

    return {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def _shard(model, mesh, engine="ragged", mp=None):
    if engine == "ragged":
        from ragged_fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    kw = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def _batch(step, world=None):
    """The global batch of ``step`` (6 rows: W = 1, 2 and 3 split it evenly)."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (6, 9), generator=g)


def _adapters(model):
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters() if "lora_" in n}


def _record(**row):
    path = os.environ.get("RAGGED_BNB4_RECORD")
    if path and dist.get_rank() == 0:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def _dequant_hook(store):
    """Forward pre-hook: the dequantised Params4bit the layer computes with."""
    import bitsandbytes.functional as F

    def hook(mod, args):
        w = mod.weight  # torch's fully_shard hands a plain Parameter; bitsandbytes then uses mod.quant_state
        qs = getattr(w, "quant_state", None) or mod.quant_state
        store.setdefault(id(mod), F.dequantize_4bit(w.data, qs).clone())
        store.setdefault(("type", id(mod)), type(w).__name__)
    return hook


def _train(model, world, rank, steps=3, group=None, capture=None):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(steps):
        x = _batch(step, world)
        if group is not None:
            x = x.chunk(world)[dist.get_rank(group)]
        loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        lt = loss.detach().clone()
        if group is not None:
            dist.all_reduce(lt, group=group)
            lt /= world
        losses.append(lt.item())
    return losses, opt


def _compare_training(rank, engine, storage, dq, worlds=(2, 3)):
    groups = _groups(rank)
    ref = _load(storage, dq)
    ref_deq = {}
    hooks = [m.register_forward_pre_hook(_dequant_hook(ref_deq)) for m in _linears4(ref).values()]
    ref_losses, _ = _train(ref, 1, rank)
    for h in hooks:
        h.remove()
    ref_ad = _adapters(ref)
    ref_order = list(_linears4(ref))
    for W in worlds:
        group, mesh = groups[W]
        if group is None:
            continue
        row = {"case": "train", "engine": engine, "storage": str(storage).removeprefix("torch."), "double_quant": dq,
               "W": W}
        model = _load(storage, dq)
        lin = _linears4(model)
        deq = {}
        for m in lin.values():
            m.register_forward_pre_hook(_dequant_hook(deq))
        try:
            _shard(model, mesh, engine)
            losses, _ = _train(model, W, rank, group=group)
        except Exception as e:  # recorded for FSDP2; ragged_fsdp must not fail
            if engine == "ragged":
                raise
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            _record(**row)
            continue
        ad = _adapters(model)
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        ad_diff = max((ad[n] - ref_ad[n]).abs().max().item() for n in ref_ad)
        bitwise = all(torch.equal(deq[id(lin[n])], ref_deq[id(_linears4(ref)[n])]) for n in ref_order)
        types = sorted({deq[("type", id(m))] for m in lin.values()})
        keys = [k for k in model.state_dict() if "layers.0.self_attn.q_proj.base_layer" in k]
        row.update(loss_rel_diff=loss_diff, adapter_abs_diff=ad_diff, base_bitwise=bitwise, layer_sees=types,
                   state_dict_keys=len(keys))
        _record(**row)
        if engine == "ragged":
            assert loss_diff < 2e-6, (W, losses, ref_losses)
            assert ad_diff < 2e-5, (W, ad_diff)
            assert bitwise, "the gathered base dequantises to other values than one process's"
            assert types == ["Params4bit"], types
            assert len(keys) == (6 if dq else 4), keys


def case_train_ragged(rank, world):
    for storage in (torch.float32, torch.bfloat16):
        for dq in (True, False):
            _compare_training(rank, "ragged", storage, dq)


def case_train_fsdp2(rank, world):
    for storage in (torch.float32, torch.bfloat16):
        for dq in (True, False):
            _compare_training(rank, "fsdp2", storage, dq)


def case_blocks_whole(rank, world):
    """Every rank's codes start on a sharding unit (whole blocks, or whole nested blocks) and
    its absmax (and nested absmax) are exactly the blocks of its codes."""
    from ragged_fsdp.placement.dcp import local_box_boxes

    _, mesh = _groups(rank)[3]
    for storage, dq in ((torch.bfloat16, True), (torch.float32, False), (torch.uint8, False)):
        ref = _load(storage, dq)
        model = _shard(_load(storage, dq), mesh)
        for (n, m), r in zip(_linears4(model).items(), _linears4(ref).values()):
            w = m.weight
            qs = r.weight.quant_state
            vpr = 2 * w.element_size()
            boxes = local_box_boxes(w)
            r0 = boxes[0][0][0] if boxes else 0
            rows = w.to_local().shape[0]
            unit = 64 * (256 if dq else 1)
            assert (r0 * vpr) % unit == 0, (n, r0)
            b0, b1 = r0 * vpr // 64, -(-(r0 + rows) * vpr // 64)
            if rows:
                assert torch.equal(w.absmax.to_local(), qs.absmax[b0:b1]), n
                if dq:
                    n0, n1 = b0 // 256, -(-b1 // 256)
                    assert torch.equal(w.nested_absmax.to_local(), qs.state2.absmax[n0:n1]), n
            else:
                assert w.absmax.to_local().numel() == 0, n


def case_mixed_precision(rank, world):
    """param_dtype other than the storage: the codes are never cast. The first loss equals one
    process whose floating parameters (adapters, norms, embeddings, head) are in param_dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    groups = _groups(rank)
    for storage, pdt in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                         (torch.uint8, torch.bfloat16)):
        ref = _load(storage, True)
        for n, p in ref.named_parameters():
            if not type(p).__name__ == "Params4bit" and p.is_floating_point():
                p.data = p.data.to(pdt)
        x = _batch(0, 2)
        with torch.no_grad():
            want = ref(x, labels=x).loss.item()
        for engine in ("ragged", "fsdp2"):
            group, mesh = groups[2]
            if group is None:
                continue
            row = {"case": "mixed_precision", "engine": engine, "storage": str(storage).removeprefix("torch."),
                   "param_dtype": str(pdt).removeprefix("torch."), "W": 2}
            model = _load(storage, True)
            try:
                _shard(model, mesh, engine, MixedPrecisionPolicy(param_dtype=pdt, reduce_dtype=torch.float32))
                xs = x.chunk(2)[dist.get_rank(group)]
                loss = model(xs, labels=xs).loss
                loss.backward()
                lt = loss.detach().float().clone()
                dist.all_reduce(lt, group=group)
                got = lt.item() / 2
                row.update(first_loss_rel_diff=abs(got - want) / abs(want))
            except Exception as e:
                if engine == "ragged":
                    raise
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            _record(**row)
            if engine == "ragged":
                # the two ranks' bf16 losses averaged against one bf16 loss of the whole batch
                assert row["first_loss_rel_diff"] < (1e-2 if pdt is torch.bfloat16 else 1e-6), row


def _shared_dir(tag):
    box = [tempfile.mkdtemp(prefix=f"bnb4-{tag}-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    return box[0]


def _full_sd(model):
    from ragged_fsdp.checkpoint import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _same_values(a: dict, b: dict, what: str):
    """Every tensor key equal bit for bit; the packed JSON compared as JSON (padding differs)."""
    from ragged_fsdp.quant.bnb4 import unpack_blob

    assert set(a) == set(b), (what, sorted(set(a) ^ set(b))[:6])
    for k in a:
        if ".quant_state.bitsandbytes__" in k:
            assert unpack_blob(a[k]) == unpack_blob(b[k]), (what, k)
        else:  # as bytes: codes in a float storage dtype may hold NaN patterns
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (what, k)
            assert torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)), (what, k)


def case_checkpoints(rank, world):
    """Saved at W = 2 after two steps (DCP, full state dict, TrainState, local save); loaded at
    W = 1 and 3 and into a one-process PEFT model, each built from *another* base (other
    statistics), bitwise; mismatched or missing statistics refused."""
    import torch.distributed.checkpoint as dcp

    from ragged_fsdp.checkpoint import StateDictOptions, TrainState, load_latest, save, set_model_state_dict
    from ragged_fsdp.quant.bnb4 import load_bnb4_state_dict, pad_bnb4_blobs

    groups = _groups(rank)
    for storage, dq in ((torch.bfloat16, True), (torch.float32, False)):
        d_dcp, d_ts, d_full = (_shared_dir(t) for t in ("dcp", "ts", "full"))
        group, mesh = groups[2]
        want = None
        if group is not None:
            src = _shard(_load(storage, dq), mesh)
            _, opt = _train(src, 2, rank, steps=2, group=group)
            sd = src.state_dict()
            keys = [k for k in sd if "layers.0.self_attn.q_proj.base_layer" in k]
            assert len(keys) == (6 if dq else 4), keys
            dcp.save(sd, checkpoint_id=d_dcp, process_group=group)
            save({"train": TrainState(src, opt)}, d_ts, process_group=group)
            want = {k: v.cpu() for k, v in _full_sd(src).items()}
            if dist.get_rank(group) == 0:
                torch.save(want, os.path.join(d_full, "full.pt"))
        box = [want]
        dist.broadcast_object_list(box, src=0)
        want = box[0]
        # one process, a PEFT model of another base: DCP into its (padded) state dict, then the
        # statistics applied by load_bnb4_state_dict; and the full state dict the same way
        for how in ("dcp", "full"):
            plain = _load(storage, dq, base="BNB4_BASE2")
            before = plain.state_dict()
            assert not all(torch.equal(before[k], want[k]) for k in want if k.endswith("absmax")), "same base?"
            if how == "dcp":
                sd1 = pad_bnb4_blobs(plain.state_dict())
                dcp.load(sd1, checkpoint_id=d_dcp, no_dist=True)
            else:
                sd1 = torch.load(os.path.join(d_full, "full.pt"), weights_only=True)
            load_bnb4_state_dict(plain, sd1)
            _same_values(plain.state_dict(), want, f"one process from {how}")
        # W = 1 and 3 (another base), sharded DCP and the full state dict
        for W in (1, 3):
            g, m = groups[W]
            for how in ("dcp", "full", "ts"):
                model = _shard(_load(storage, dq, base="BNB4_BASE2"), m)
                if how == "dcp":
                    sd = model.state_dict()
                    dcp.load(sd, checkpoint_id=d_dcp, process_group=g)
                    model.load_state_dict(sd)
                elif how == "full":
                    full = torch.load(os.path.join(d_full, "full.pt"), weights_only=True)
                    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
                else:
                    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
                    load_latest(d_ts, {"train": TrainState(model, opt)}, process_group=g)
                _same_values({k: v.cpu() for k, v in _full_sd(model).items()}, want, f"W={W} from {how}")
        # refused: a checkpoint of another quantisation, and codes without their statistics
        other = _shard(_load(storage, not dq, base="BNB4_BASE2"), groups[3][1])
        sd = {k: v for k, v in want.items()}
        with pytest.raises(ValueError, match="bitsandbytes"):
            set_model_state_dict(other, sd, options=StateDictOptions(full_state_dict=True, strict=False))
        same = _shard(_load(storage, dq, base="BNB4_BASE2"), groups[3][1])
        bare = {k: v for k, v in want.items() if not (".weight." in k and "base_layer" in k)}
        with pytest.raises(RuntimeError, match="missing keys"):  # the strict full loader names them
            set_model_state_dict(same, bare, options=StateDictOptions(full_state_dict=True))
        with pytest.raises(ValueError, match="without its bitsandbytes statistics"):
            set_model_state_dict(same, bare, options=StateDictOptions(full_state_dict=True, strict=False))
        plain = _load(storage, not dq, base="BNB4_BASE2")
        with pytest.raises(ValueError, match="bitsandbytes quantisation differs"):
            load_bnb4_state_dict(plain, want)


def case_local_save(rank, world):
    """The flat local save (no collective; its meshes span the world, so W = 3), loaded into a
    model of another base: in place, then load_state_dict applies the offset (a gather before
    that refuses)."""
    from ragged_fsdp.checkpoint import load_local, save_local

    groups = _groups(rank)
    d = _shared_dir("local")
    group, mesh = groups[3]
    src = _shard(_load(torch.bfloat16, True), mesh)
    _train(src, 3, rank, steps=1, group=group)
    save_local(src.state_dict(), d)
    want = {k: v.cpu() for k, v in _full_sd(src).items()}
    model = _shard(_load(torch.bfloat16, True, base="BNB4_BASE2"), groups[3][1])
    sd = model.state_dict()
    load_local(sd, d)
    x = _batch(0, 3).chunk(3)[rank]
    with pytest.raises(RuntimeError, match="load_state_dict"):
        model(x, labels=x)
    model.load_state_dict(sd)
    _same_values({k: v.cpu() for k, v in _full_sd(model).items()}, want, "local save W=3, another base")
    model(x, labels=x).loss.backward()


def case_eval_trap(rank, world):
    """bitsandbytes' CPU repack on eval() under no_grad (forced on here, as on a CPU with
    avx512-bf16): in one process every later forward changes; under fully_shard the repack is
    off (the losses after eval are the ones before), and a weight replaced anyway is refused."""
    x = _batch(0, 1)
    ref = _load(torch.bfloat16, True)
    for m in _linears4(ref).values():
        m.support_avx512bf16_for_cpu = True
    with torch.no_grad():
        before = ref(x, labels=x).loss.item()
        ref.eval()
        ref(x, labels=x)
        ref.train()
        after = ref(x, labels=x).loss.item()
    single_changed = before != after
    assert single_changed, "the repack did not change the one-process model (bitsandbytes changed?)"
    group, mesh = _groups(rank)[2]
    for engine in ("ragged", "fsdp2"):
        if group is None:
            continue
        model = _load(torch.bfloat16, True)
        for m in _linears4(model).values():
            m.support_avx512bf16_for_cpu = True
        _shard(model, mesh, engine)
        xs = x.repeat(2, 1).chunk(2)[dist.get_rank(group)]
        row = {"case": "eval", "engine": engine, "W": 2, "one_process_changed": single_changed}
        try:
            with torch.no_grad():
                b = model(xs, labels=xs).loss.item()
                model.eval()
                model(xs, labels=xs)
                model.train()
                a = model(xs, labels=xs).loss.item()
            row.update(changed=a != b, loss_before=b, loss_after=a)
        except Exception as e:
            if engine == "ragged":
                raise
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        _record(**row)
        if engine == "ragged":
            assert a == b, (b, a)
            # turned back on by hand: the next gather refuses the replaced weight
            for m in _linears4(model).values():
                m.support_avx512bf16_for_cpu = True
            with torch.no_grad():
                model.eval()
                model(xs, labels=xs)
                with pytest.raises(RuntimeError, match="replaced during forward"):
                    model(xs, labels=xs)


CASES = [case_train_ragged, case_blocks_whole, case_mixed_precision, case_checkpoints, case_local_save,
         case_eval_trap, case_train_fsdp2]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("bnb4")
    for env, seed in (("BNB4_BASE", 0), ("BNB4_BASE2", 7)):
        _save_base(str(root / env), seed)
        os.environ[env] = str(root / env)
    return run_cases(WORLD, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_case(results, case):
    check_case(results, case, WORLD)
