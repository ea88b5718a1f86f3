"""The simulator's recipe options (compile, float8 and float8 / block-FP8 all-gathers, async
TP, PP schedules and microbatches, CP, per-op SAC), the per-phase overlap, the breakdown by
cause, and the fitted constants against their fit points. Pure and fast (seconds)."""
from __future__ import annotations

import contextlib
import json
import math

import pytest

from ragged_fsdp.cli import main as cli_main
from ragged_fsdp.sim import fitted
from ragged_fsdp.sim.arch import resolve_model
from ragged_fsdp.sim.compute import op_sac
from ragged_fsdp.sim.mesh import Mesh, parse_mesh
from ragged_fsdp.sim.options import Recipe
from ragged_fsdp.sim.pipeline import bubble, in_flight, stage_layers
from ragged_fsdp.sim.profiles import get_profile
from ragged_fsdp.sim.simulate import Scenario, simulate

H100 = get_profile("h100")


def _run(model="llama3-8b", gpus=64, mesh=None, fw=("fsdp2",), **kw):
    recipe = Recipe(**{k: kw.pop(k) for k in list(kw) if k in Recipe.__dataclass_fields__})
    sc = Scenario(model, gpus, kw.pop("profile", H100), mesh or Mesh(gpus), seq=kw.pop("seq", 8192),
                  micro_batch=kw.pop("micro_batch", 1), act_ckpt=kw.pop("act_ckpt", "full"), recipe=recipe, **kw)
    res = simulate(sc, fw)
    return res[0] if len(fw) == 1 else {r.framework: r for r in res}


def test_mesh_pp_cp_parse():
    assert parse_mesh("pp=8,tp=8,dp=8", 512) == Mesh(8, 1, 8, 1, 8, 1)
    assert parse_mesh("cp=4,dp=2", 8) == Mesh(2, 1, 1, 1, 1, 4)
    assert str(Mesh(8, 1, 8, 1, 8, 2)) == "pp=8,cp=2,tp=8,dp=8"
    assert Mesh(2, 1, 1, 1, 1, 4).shard == 8  # CP ranks shard the parameters too (dp_shard_cp)


def test_compile_and_float8_speed_up_compute_only():
    base = _run()
    comp = _run(compile=True)
    fp8 = _run(compile=True, float8="tensorwise")
    row = _run(compile=True, float8="rowwise")
    assert base.tokens_per_s_per_gpu < comp.tokens_per_s_per_gpu < fp8.tokens_per_s_per_gpu
    assert comp.tokens_per_s_per_gpu < row.tokens_per_s_per_gpu < fp8.tokens_per_s_per_gpu
    # the speed-up lands on compute only: bounded by the constant
    assert comp.time_parts["compute"] / base.time_parts["compute"] >= 1 / fitted.COMPILE_SPEEDUP - 1e-9
    # blocks compiled, loss eager (torchtitan's Dec 2024 runs): memory unchanged; the compiled
    # loss (the default with compile) drops the fp32 logits and log-probs: 12 -> 4 B per logit
    blocks = _run(compile=True, compile_loss=False)
    assert blocks.memory_bytes == base.memory_bytes
    assert blocks.tokens_per_s_per_gpu == pytest.approx(comp.tokens_per_s_per_gpu)
    assert base.peak_phase == "loss"
    saved = 8 * 8192 * 128256 * (1 + H100.alloc_reserve)
    assert base.memory_items["logits and loss"] == pytest.approx(12 * 8192 * 128256)
    # at most that much lower (the peak may move to another phase)
    assert 0.5 * saved < base.memory_bytes - comp.memory_bytes <= saved * (1 + 1e-9)


def test_gemm_roofline_makes_skinny_tp_matmuls_memory_bound():
    from ragged_fsdp.sim.compute import Linear, linear_times
    rate = H100.flops * H100.efficiency

    def shaped(lin, speedup=1.0):  # each dim d saturates as d / (d + 64)
        return rate * speedup * math.prod(d / (d + 64) for d in (lin.m, lin.n, lin.k))

    big = Linear("model.layers.0.mlp.gate_proj.weight", 98304, 4096, 14336, 1, True, False, False)
    kv = Linear("model.layers.0.self_attn.k_proj.weight", 98304, 4096, 128, 1, True, False, False)
    for lin in (big, kv):
        f, d, w = linear_times(lin, H100, Recipe())
        by_flops = lin.flops / shaped(lin)
        by_bytes = 2 * (lin.m * lin.k + lin.k * lin.n + lin.m * lin.n) / H100.mem_bw
        assert f == pytest.approx(max(by_flops, by_bytes))
    assert linear_times(big, H100, Recipe())[0] == pytest.approx(big.flops / shaped(big))  # compute-bound
    f_kv = linear_times(kv, H100, Recipe())[0]
    assert f_kv > 1.2 * kv.flops / rate  # TP 8's k projection (N = 128): far below the large-GEMM rate
    # float8: the compute-bound GEMM gains the fitted rate; the skinny one is bound by its
    # shaped rate or its bytes (1-byte inputs, bf16 output), whichever is slower
    sp = fitted.FLOAT8_SPEEDUP["tensorwise"]
    g8 = linear_times(big, H100, Recipe(float8="tensorwise"))[0]
    k8 = linear_times(kv, H100, Recipe(float8="tensorwise"))[0]
    assert linear_times(big, H100, Recipe())[0] / g8 == pytest.approx(sp)
    m, k, n = kv.m, kv.k, kv.n
    assert k8 == pytest.approx(max(kv.flops / shaped(kv, sp), (m * k + k * n + 2 * m * n) / H100.mem_bw))


def test_float8_gains_less_under_tp8_casts_are_memory_bound():
    """The casts scale with the tensors, the GEMMs with M N K: at TP 8 the per-rank GEMMs of
    Llama 3 8B are 8x smaller while a column-parallel input is cast whole, so float8's gain
    shrinks (torchtitan's async-TP table: +16% at TP 8 for 8B vs +28% on FSDP alone)."""
    kw = dict(gpus=64, micro_batch=2, act_ckpt="op", compile=True)
    fsdp = _run(**kw).tokens_per_s_per_gpu, _run(float8="tensorwise", **kw).tokens_per_s_per_gpu
    m = parse_mesh("tp=8,dp=8", 64)
    tp = (_run(mesh=m, **kw).tokens_per_s_per_gpu, _run(mesh=m, float8="tensorwise", **kw).tokens_per_s_per_gpu)
    assert fsdp[1] / fsdp[0] > tp[1] / tp[0] > 1.0


def test_tp_op_sac_reruns_all_gathers_and_vanilla_pays_the_dim1_copies():
    from ragged_fsdp.sim.comm import collective_time
    from ragged_fsdp.sim.tensor_parallel import tp_block_comm
    tok, h = 8192.0, 4096
    ag = collective_time(H100, "all_gather", tok * h * 2, 8)
    none_e, none_t = tp_block_comm(H100, 8, 1, tok, h, 2, 2, "none", False, 0.0)
    op_e, op_t = tp_block_comm(H100, 8, 1, tok, h, 2, 2, "op", False, 0.0)
    copy = 2 * tok * h * 2 / H100.mem_bw  # read + write of one unsharded activation
    assert op_t - none_t == pytest.approx(2 * ag + 2 * copy)
    assert none_t == pytest.approx(8 * ag + 8 * copy, rel=1e-6)  # AG and RS cost the same here
    # async TP: the chunks land in place, but the fused RS sums tp partials on the compute stream
    feed = [1.0, 1.0, 1.0, 1.0]  # matmuls long enough to hide every ring step but one
    a_e, _ = tp_block_comm(H100, 8, 1, tok, h, 2, 2, "none", True, 0.0, feed)
    assert a_e == pytest.approx(8 * ag / 8 + 4 * tok * h * 2 * (1 + 1 / 8) / H100.mem_bw)
    # a matmul too short to hide its collective leaves the rest exposed
    short, _ = tp_block_comm(H100, 8, 1, tok, h, 2, 2, "none", True, 0.0, [0.0] * 4)
    assert short == pytest.approx(none_t - 8 * copy + 4 * tok * h * 2 * (1 + 1 / 8) / H100.mem_bw)


def test_float8_allgather_halves_block_gathers_and_block_fp8_adds_scales():
    r = _run(fw=("ragged", "fsdp2"), gpus=256, float8="tensorwise")
    g = _run(fw=("ragged", "fsdp2"), gpus=256, float8="tensorwise", float8_allgather=True)
    for fw in ("ragged", "fsdp2"):
        # forward gather + backward re-gather at 2 -> ~1 byte of 8 bytes per element (fp32
        # reduce-scatter unchanged): the total drops towards 6/8; the embedding and head stay bf16
        ratio = g[fw].comm_phases["FSDP total (hidden or not)"] / r[fw].comm_phases["FSDP total (hidden or not)"]
        assert 0.74 < ratio < 0.82, (fw, ratio)
    # BlockFP8: one fp32 scale per 128x128 tile more than torchao's tensorwise bytes
    assert g["ragged"].memory_bytes <= g["fsdp2"].memory_bytes
    with pytest.raises(ValueError, match="tensorwise recipe only"):
        _run(float8="rowwise", float8_allgather=True)
    with pytest.raises(ValueError, match="needs --float8"):
        _run(float8_allgather=True)


def test_mxfp8_allgather_prices_ragged_gathers_at_one_plane():
    """--mxfp8-allgather: ragged_fsdp gathers the mxfp8 linears at 1 + 1/32 byte per element
    (one plane per gather); FSDP2 with torchao's recipe still gathers them in bf16."""
    from ragged_fsdp.sim.mx_gather import MXFP8_BYTES, gather_itemsize

    assert gather_itemsize("ragged", False, True) == MXFP8_BYTES == 1 + 1 / 32
    assert gather_itemsize("fsdp2", False, True) is None
    r = _run(fw=("ragged", "fsdp2"), gpus=256, float8="mxfp8", profile=get_profile("b200"))
    g = _run(fw=("ragged", "fsdp2"), gpus=256, float8="mxfp8", mxfp8_allgather=True, profile=get_profile("b200"))
    key = "FSDP total (hidden or not)"
    assert g["fsdp2"].comm_phases[key] == r["fsdp2"].comm_phases[key]
    ratio = g["ragged"].comm_phases[key] / r["ragged"].comm_phases[key]
    assert 0.74 < ratio < 0.83, ratio  # as --float8-allgather: 2 -> ~1.03 of 8 bytes per element
    with pytest.raises(ValueError, match="--mxfp8-allgather needs --float8 mxfp8"):
        _run(float8="tensorwise", mxfp8_allgather=True)


def test_async_tp_hides_tp_collectives():
    m = Mesh(8, 1, 8)
    van = _run("llama3-70b", 64, m, micro_batch=4, compile=True)
    asy = _run("llama3-70b", 64, m, micro_batch=4, compile=True, async_tp=True)
    assert van.time_parts["tp collectives (exposed)"] > 0
    assert asy.time_parts["tp collectives (exposed)"] < 0.5 * van.time_parts["tp collectives (exposed)"]
    assert asy.tokens_per_s_per_gpu > van.tokens_per_s_per_gpu
    with pytest.raises(ValueError, match="needs a TP mesh"):
        _run(async_tp=True)


def test_pp_bubble_and_in_flight():
    assert stage_layers(126, 8) == [16] * 6 + [15] * 2
    assert bubble("1f1b", 8, 2) == 7 and bubble("interleaved_1f1b", 8, 2) == 3.5
    assert bubble("zero_bubble", 8, 2) == pytest.approx(7 / 3)
    assert in_flight("1f1b", 8, 2, 0, 32) == 8 and in_flight("1f1b", 8, 2, 7, 32) == 1
    assert in_flight("interleaved_1f1b", 8, 2, 0, 32) > 8
    mesh = Mesh(2, 1, 1, 1, 4)
    res = {s: _run("llama3-8b", 8, mesh, micro_batch=8, pp_schedule=s) for s in ("1f1b", "interleaved_1f1b", "zero_bubble")}
    t = {s: r.tokens_per_s_per_gpu for s, r in res.items()}
    assert t["1f1b"] < t["interleaved_1f1b"] and t["1f1b"] < t["zero_bubble"]
    assert res["1f1b"].time_parts["pp bubble"] > 0
    more = _run("llama3-8b", 8, mesh, micro_batch=32)
    assert more.tokens_per_s_per_gpu > t["1f1b"]  # more microbatches amortise the bubble
    assert res["1f1b"].peak_stage in (0, 3)  # the most in flight (first) or the loss (last)
    with pytest.raises(ValueError, match="must divide"):
        _run("llama3-8b", 8, mesh, micro_batch=8, microbatches=3)
    with pytest.raises(ValueError, match="each stage needs a microbatch"):
        _run("llama3-8b", 8, mesh, micro_batch=2)
    with pytest.raises(ValueError, match="exceeds the model's 32 layers"):
        _run("llama3-8b", 64, Mesh(1, 1, 1, 1, 64), micro_batch=64)


def test_cp_splits_sequence_and_memory():
    one = _run(gpus=8, mesh=Mesh(8), seq=32768, compile=True)
    cp = _run(gpus=8, mesh=Mesh(2, 1, 1, 1, 1, 4), seq=131072, compile=True)
    # per-rank tokens equal (32k); attention per token is 4x longer: slower, same loss memory
    assert cp.tokens_per_s_per_gpu < one.tokens_per_s_per_gpu
    assert cp.memory_items["logits and loss"] == pytest.approx(one.memory_items["logits and loss"])
    assert cp.comm_phases["CP ring total (hidden or not)"] > 0
    with pytest.raises(ValueError, match="multiple of 2 x cp"):
        _run(gpus=8, mesh=Mesh(2, 1, 1, 1, 1, 4), seq=1002)


def test_op_sac_between_full_and_none():
    a = resolve_model("llama3-8b")
    saved, rec, tot = op_sac(a.groups[1][1], 1.0)
    # q, v, gate, down saved; k, o, up recomputed (torchtitan: every second mm)
    assert saved == 4096 + 1024 + 14336 + 4096
    assert rec == 1024 * 4096 + 4096 * 4096 + 14336 * 4096
    r = {m: _run(gpus=8, micro_batch=2, act_ckpt=m) for m in ("none", "op", "full")}
    assert r["none"].memory_bytes > r["op"].memory_bytes > r["full"].memory_bytes
    assert r["none"].step_s < r["op"].step_s < r["full"].step_s


def test_long_sequence_loss_and_tp_memory():
    r = _run(gpus=8, seq=32768, act_ckpt="full")
    assert r.memory_items["logits and loss"] == pytest.approx(32768 * 128256 * 12)  # measured 11.7 B/logit
    t = _run("llama3-70b", 64, Mesh(8, 1, 8), seq=32768)
    # loss_parallel's decomposed log-softmax: 16 B per local logit (MemTracker: 15.9)
    assert t.memory_items["logits and loss"] == pytest.approx(32768 * 128256 * 16 / 8)


def test_breakdown_sums_to_the_difference():
    r = _run(fw=("ragged", "fsdp2", "megatron"), gpus=1024, mesh=Mesh(1024))
    for fw in ("fsdp2", "megatron"):
        d = r[fw].vs_ragged
        assert sum(d["step_s"].values()) == pytest.approx(r[fw].step_s - r["ragged"].step_s, abs=1e-9)
        assert sum(d["memory_bytes"].values()) == pytest.approx(r[fw].memory_bytes - r["ragged"].memory_bytes)
    assert r["fsdp2"].vs_ragged["step_s"]["copy-out / copy-in"] > 0
    assert not r["ragged"].vs_ragged


def test_per_phase_overlap_exposes_comm_when_compute_is_short():
    slow = H100.with_overrides(net_bw=H100.net_bw / 20)
    fast = _run("llama3-70b", 1024, Mesh(1024))
    bound = _run("llama3-70b", 1024, Mesh(1024), profile=slow)
    assert bound.comm_phases["all-gather + reduce-scatter (backward)"] > 0
    assert bound.time_parts["exposed comm"] > 10 * fast.time_parts["exposed comm"]
    assert bound.time_parts["compute"] == pytest.approx(fast.time_parts["compute"])
    assert bound.step_s == pytest.approx(sum(bound.time_parts.values()))


def test_fitted_constants_reproduce_their_fit_points():
    from ragged_fsdp.sim.validate import load_points, predict

    pts = {p["id"]: p for p in load_points()["points"]}
    for key, pid in fitted.FIT_POINTS.items():
        p = pts[pid]
        assert p["role"] == "fit"
        r = predict(p)
        if key == "allocator_reserve":
            assert r.memory_bytes / 2**30 == pytest.approx(p["memory_gib"], rel=0.01), pid
        else:
            assert r.tokens_per_s_per_gpu == pytest.approx(p["tokens_per_s"], rel=0.01), pid
    roles = [p["role"] for p in pts.values()]
    assert roles.count("validate") >= 12
    assert all(p["source"].startswith("https://") and p["table"] and p["row"] for p in pts.values())


def test_cli_recipe_flags_and_json(capsys):
    assert cli_main(["simulate", "--model", "llama3-8b", "--gpus", "64", "--mesh", "pp=2,tp=4,dp=8",
                     "--micro-batch", "4", "--compile", "--float8", "tensorwise", "--float8-allgather",
                     "--async-tp", "--pp-schedule", "zero_bubble", "--act-ckpt", "op",
                     "--frameworks", "ragged,fsdp2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["scenario"]["recipe"]["pp_schedule"] == "zero_bubble"
    f2 = doc["results"][1]
    assert f2["vs_ragged"]["step_s"] and math.isfinite(f2["tokens_per_s_per_gpu"])
    assert cli_main(["simulate", "--model", "llama3-8b", "--gpus", "64", "--frameworks", "ragged,fsdp2"]) == 0
    assert "vs ragged:" in capsys.readouterr().out


def _loss_bytes_per_logit(wrap=lambda t: t, context=contextlib.nullcontext) -> float:
    """MemTracker's peak of torchtitan's loss (bf16 logits -> fp32 cross-entropy, forward and
    backward) per logit, less the inputs and their gradients; ``wrap`` turns the local logits
    into what the loss sees, ``context`` is entered around it."""
    import torch
    import torch.nn.functional as F
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    n, v, h = 1024, 4096, 64
    x = torch.randn(n, h, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(v, h, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, v, (n,))
    mt = MemTracker()
    mt.track_external(x, w)
    with mt:
        logits = wrap(x @ w.t())
        with context():
            loss = F.cross_entropy(logits.float(), y)
            del logits
            loss.backward()
    peak = sum(d["Total"] for d in mt.get_tracker_snapshot("peak").values())
    return (peak - 2 * 2 * (n * h + v * h)) / (n * v)


def test_loss_bytes_per_logit_match_memtracker():
    """The loss term that dominates long-sequence peaks, on a small CPU case."""
    from ragged_fsdp.sim.simulate import LOSS_BYTES_PER_LOGIT

    per_logit = _loss_bytes_per_logit()
    assert abs(per_logit / LOSS_BYTES_PER_LOGIT - 1) < 0.10, per_logit


def test_loss_parallel_bytes_per_logit_match_memtracker():
    """Under TP the loss is DTensor's loss_parallel on vocab-sharded logits (torchtitan's
    default): its decomposed log-softmax keeps more fp32 copies alive than the fused one.
    One rank in-process (two ranks measured the same per local logit)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    from ragged_fsdp.sim.simulate import LOSS_BYTES_PER_LOGIT, LOSS_BYTES_PER_LOGIT_PARALLEL

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        per_logit = _loss_bytes_per_logit(lambda t: DTensor.from_local(t, mesh, [Shard(1)]), loss_parallel)
    finally:
        dist.destroy_process_group()
    assert abs(per_logit / LOSS_BYTES_PER_LOGIT_PARALLEL - 1) < 0.10, per_logit
    assert per_logit > 1.2 * LOSS_BYTES_PER_LOGIT  # clearly not the plain loss's count


def test_mesh_auto_keeps_meshes_the_recipe_allows(capsys):
    assert cli_main(["simulate", "--model", "llama3-8b", "--gpus", "16", "--mesh", "auto", "--async-tp",
                     "--frameworks", "ragged"]) == 0
    out = capsys.readouterr().out
    assert "tp=" in out.splitlines()[2]
    assert cli_main(["simulate", "--model", "llama3-8b", "--gpus", "16", "--mesh", "auto", "--microbatches", "2",
                     "--micro-batch", "2", "--frameworks", "ragged"]) == 2
    assert "no candidate mesh" in capsys.readouterr().err


def test_grad_wire_sends_the_formats_bytes_and_adds_its_local_work():
    """--grad-wire: the shard dim's reduction sends the format's bytes per element (codes
    plus one fp32 scale per 128 elements) instead of fp32's 4, adds the quantise and
    dequantise + fp32 sum, and changes nothing for the frameworks without the option."""
    base = _run("llama3-70b", 64, fw=("ragged", "fsdp2"))
    assert base["ragged"].grad_reduce["format"] == "fp32 reduce-scatter"
    assert base["ragged"].time_parts["gradient wire quantise"] == 0
    for wire, per_elem in (("bf16", 2.0), ("int8", 1 + 4 / 128), ("fp8", 1 + 4 / 128)):
        r = _run("llama3-70b", 64, fw=("ragged", "fsdp2"), grad_wire=wire)
        ratio = r["ragged"].grad_reduce["sent_bytes"] / base["ragged"].grad_reduce["sent_bytes"]
        assert ratio == pytest.approx(per_elem / 4), wire
        assert r["ragged"].grad_reduce["wire_local_s"] > r["ragged"].time_parts["gradient wire quantise"] > 0
        assert r["ragged"].memory_bytes == base["ragged"].memory_bytes  # no residual without error feedback
        assert r["fsdp2"].step_s == base["fsdp2"].step_s and r["fsdp2"].grad_reduce == base["fsdp2"].grad_reduce
        assert "gradient wire quantise / error feedback (ragged_fsdp's gradient_reduce)" in r["fsdp2"].vs_ragged["step_s"]
    # error feedback: more local work, and a persistent residual of the pieces a rank sends
    # ((W-1)/W of the unsharded gradient: the own segment is summed exact), by default int8
    # codes plus an fp32 scale per 128-element block for the int8 wire
    q = _run("llama3-70b", 64, fw=("ragged",), grad_wire="int8")
    ef = _run("llama3-70b", 64, fw=("ragged",), grad_wire="int8", grad_wire_ef=True)
    assert ef.grad_reduce["sent_bytes"] == q.grad_reduce["sent_bytes"]
    assert ef.time_parts["gradient wire quantise"] > q.time_parts["gradient wire quantise"]
    params = resolve_model("llama3-70b").params
    assert ef.grad_reduce["residual"] == "int8"
    assert ef.grad_reduce["feedback_bytes"] == pytest.approx(63 / 64 * (1 + 4 / 128) * params, rel=0.01)
    assert ef.memory_items["error-feedback residuals"] == ef.grad_reduce["feedback_bytes"]
    assert ef.memory_bytes - q.memory_bytes >= ef.grad_reduce["feedback_bytes"]
    for store, per_elem in (("fp32", 4.0), ("bf16", 2.0)):
        r = _run("llama3-70b", 64, fw=("ragged",), grad_wire="int8", grad_wire_ef=True, grad_wire_residual=store)
        assert r.grad_reduce["feedback_bytes_per_element"] == pytest.approx(63 / 64 * per_elem), store
    assert _run("llama3-70b", 64, fw=("ragged",), grad_wire="fp8", grad_wire_ef=True).grad_reduce["residual"] == "bf16"


def test_grad_wire_bytes_match_the_engines_block_format():
    """The simulator's bytes per element are the engine's: on a planned layout of 128-wide
    rows, ``quant.grad_wire.wire_bytes`` sends one code byte per element and 4 bytes per
    128-element block."""
    import torch

    from ragged_fsdp import GradientReduce
    from ragged_fsdp.dbuffer.planning import plan_layout
    from ragged_fsdp.quant.grad_wire import DEFAULT_BLOCK, wire_blocks, wire_bytes
    from ragged_fsdp.sim.options import WIRE_BLOCK, WIRE_BYTES, wire_bytes_per_element

    assert WIRE_BLOCK == DEFAULT_BLOCK == GradientReduce().block_size
    world = 4
    lay = plan_layout([("w1", (512, 128), None), ("w2", (256, 128), None)], world, 0, itemsize=4)
    blocks = wire_blocks(lay)
    for name, dtype in (("bf16", torch.bfloat16), ("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
        sent, _ = wire_bytes(blocks, GradientReduce(dtype), 0)
        assert sent / ((world - 1) * lay.segment) == pytest.approx(WIRE_BYTES[name]), name
        assert WIRE_BYTES[name] == wire_bytes_per_element(name)
    # other block sizes, on a layout of 128-row units (cut into blocks by the engine), 2 per rank
    lay = plan_layout([("w1", (512, 128), "rows:128"), ("w2", (512, 128), "rows:128")], world, 0, itemsize=4)
    for block in (32, 64, 256):
        for name, dtype in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
            sent, _ = wire_bytes(wire_blocks(lay, block), GradientReduce(dtype, block_size=block), 0)
            per_element = sent / ((world - 1) * lay.segment)
            assert per_element == pytest.approx(wire_bytes_per_element(name, block)), (name, block)


def test_grad_wire_block_option():
    """--grad-wire-block N: 1 + 4/N bytes per element on the wire and in int8 residual
    storage; refused without an int8 / fp8 wire or below 1."""
    base = _run("llama3-70b", 64, fw=("ragged",), grad_wire="int8", grad_wire_ef=True)
    small = _run("llama3-70b", 64, fw=("ragged",), grad_wire="int8", grad_wire_ef=True, grad_wire_block=32)
    ratio = (1 + 4 / 32) / (1 + 4 / 128)
    assert small.grad_reduce["sent_bytes"] / base.grad_reduce["sent_bytes"] == pytest.approx(ratio)
    assert small.grad_reduce["feedback_bytes"] / base.grad_reduce["feedback_bytes"] == pytest.approx(ratio)
    assert "32-element blocks" in small.grad_reduce["format"]
    with pytest.raises(ValueError, match="--grad-wire-block .*add --grad-wire int8"):
        _run(grad_wire="bf16", grad_wire_block=32)
    with pytest.raises(ValueError, match="--grad-wire-block 0 must be an int >= 1"):
        _run(grad_wire="int8", grad_wire_block=0)


def test_grad_wire_bad_input_names_the_option(capsys):
    with pytest.raises(ValueError, match="--grad-wire 'int4'"):
        _run(grad_wire="int4")
    with pytest.raises(ValueError, match="--grad-wire-ef needs --grad-wire"):
        _run(grad_wire_ef=True)
    with pytest.raises(ValueError, match="use --grad-wire-residual bf16"):
        _run(grad_wire="fp8", grad_wire_ef=True, grad_wire_residual="int8")
    with pytest.raises(ValueError, match="add --grad-wire-ef"):
        _run(grad_wire="int8", grad_wire_residual="bf16")
    assert cli_main(["simulate", "--model", "llama3-8b", "--gpus", "64", "--frameworks", "ragged",
                     "--grad-wire-ef"]) == 2
    assert "--grad-wire-ef needs --grad-wire" in capsys.readouterr().err
    assert cli_main(["simulate", "--model", "llama3-8b", "--gpus", "64", "--frameworks", "ragged",
                     "--grad-wire", "fp8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["scenario"]["recipe"]["grad_wire"] == "fp8"
    assert doc["results"][0]["grad_reduce"]["format"] == "fp8 wire, fp32 sum"
