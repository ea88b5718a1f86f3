"""The optimizers on n-D layouts (HSDP, TP colwise/rowwise, EP experts), W=4 on a 2x2 mesh.

Parameters are RaggedDTensors built with ``ragged_fsdp.distribute_tensor`` (what
``fully_shard`` makes on such meshes), with odd shapes, uneven RaggedShard cuts and ranks that
hold nothing; every step gets the same full gradient, distributed like the parameter.

* Muon: bitwise equal to ``torch.optim.Muon`` on the full tensors (3-D experts: one matrix
  each) and to our Muon on plain tensors: the owner orthogonalises the whole global matrix
  (TP tiles gathered from the RaggedShard and TP ranks), all else is pointwise.
* Muon's AdamW groups and the grouped ``AdamW``: bitwise equal to ``torch.optim.AdamW
  (foreach=False)`` (pointwise on local tensors).
* AdamW8bit: blocks are cut from the TP/EP-local tensor, so the result is bitwise that of
  AdamW8bit on each TP/EP-local tensor alone (and the same for two data-parallel cuts, one of
  them "dp size 1": every unit on one rank); with HSDP, or TP pieces that are whole blocks,
  bitwise equal to AdamW8bit on the full tensor.
* State dicts reload under another data-parallel cut (DTensor and full states) and continue
  bitwise; 8-bit states from another TP degree are refused; Shampoo runs HSDP bitwise and
  refuses TP/EP.
"""
from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import ragged_fsdp as rf
from ragged_fsdp import RaggedShard

from _dist import check_case, run_cases

WORLD = 4
R = RaggedShard


def _mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))


def _full(t):
    return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t


def _n(shape):
    n = 1
    for s in shape:
        n *= s
    return n


# (shape, placements on the 2x2 mesh): HSDP = (Replicate, ragged); TP colwise = (ragged,
# Shard(0)); TP rowwise = (ragged, Shard(1)); EP = (ragged, Shard(0)) on stacked experts.
MUON = [
    ((13, 7), (Replicate(), R((0, 1), (91, 0)))),  # HSDP, one shard rank empty
    ((7, 13), (Replicate(), R((0, 1), (40, 51)))),  # HSDP, element cut
    ((10, 7), (R((0, 1), (12, 23)), Shard(0))),  # colwise, tall, element cut
    ((6, 9), (R((0,), (0, 3)), Shard(0))),  # colwise, a dp rank empty
    ((4, 11), (R((0, 1), (9, 13)), Shard(0))),  # colwise, wide tile
    ((7, 10), (R((0, 1), (17, 18)), Shard(1))),  # rowwise, element cut
    ((9, 6), (R((), (0, 1)), Shard(1))),  # rowwise, whole tile on dp rank 1
    ((6, 5), (Shard(0), R((0,), (2, 1)))),  # TP first on the mesh, ragged second
    ((4, 5, 6), (R((0, 1, 2), (37, 23)), Shard(0))),  # EP: 2 experts per EP rank, cut inside one
    ((2, 3, 7), (R((0, 1), (3, 0)), Shard(0))),  # EP: 1 expert per EP rank, dp rank empty
    ((3, 4, 5), (R((0, 1, 2), (11, 19)), Shard(1))),  # stacked matrices, TP on their rows
]
ADAM = [  # Muon's AdamW groups: 1-D and embeddings on the same kinds of layouts
    ((20,), (Replicate(), R((0,), (7, 13)))),
    ((8,), (R((0,), (4, 0)), Shard(0))),
    ((11, 6), (R((0, 1), (10, 23)), Shard(1))),
]


def _init(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def _grads(shapes, step):
    return _init(shapes, 1000 + step)


def _dist(x, pl, mesh, requires_grad=False):
    return rf.distribute_tensor(x.clone(), mesh, pl, src_data_rank=None).requires_grad_(requires_grad)


def _set_grads(ps, layouts, step, mesh):
    for p, g, (_, pl) in zip(ps, _grads([s for s, _ in layouts], step), layouts):
        p.grad = _dist(g, pl, mesh) if pl is not None else g.clone()


def _muon_groups(ps, kw, adam_kw):
    n = len(MUON)
    return [{"params": ps[:n], **kw}, {"params": ps[n:], "use_muon": False, **adam_kw}]


KW = {"lr": 0.02, "weight_decay": 0.1}
ADAM_KW = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}


def _muon_run(layouts, steps, mesh=None, opt=None, ps=None, first=0):
    from ragged_fsdp.optim import Muon

    if ps is None:
        init = _init([s for s, _ in layouts], 7)
        ps = [_dist(x, pl, mesh, True) if pl is not None else x.clone().requires_grad_()
              for x, (_, pl) in zip(init, layouts)]
        opt = Muon(_muon_groups(ps, KW, ADAM_KW))
    for step in range(first, first + steps):
        _set_grads(ps, layouts, step, mesh)
        opt.step()
    return ps, opt


def case_muon_bitwise_vs_torch(rank, world):
    mesh = _mesh()
    layouts = MUON + ADAM
    ps, opt = _muon_run(layouts, 4, mesh)
    # torch's Muon is 2-D only: a 3-D tensor is a list of matrices; AdamW for the rest
    init = _init([s for s, _ in layouts], 7)
    mats = [[x[k].clone().requires_grad_() for k in range(x.shape[0])] if x.dim() == 3 else [x.clone().requires_grad_()]
            for x in init[:len(MUON)]]
    adam = [x.clone().requires_grad_() for x in init[len(MUON):]]
    t_muon = torch.optim.Muon([q for m in mats for q in m], **KW)
    t_adam = torch.optim.AdamW(adam, foreach=False, **ADAM_KW)
    for step in range(4):
        gs = _grads([s for s, _ in layouts], step)
        for m, g in zip(mats, gs):
            for k, q in enumerate(m):
                q.grad = (g[k] if g.dim() == 3 else g).clone()
        for q, g in zip(adam, gs[len(MUON):]):
            q.grad = g.clone()
        t_muon.step()
        t_adam.step()
    want = [torch.stack(m) if len(s) == 3 else m[0] for m, (s, _) in zip(mats, MUON)] + adam
    for p, w, (s, pl) in zip(ps, want, layouts):
        got = p.full_tensor()
        assert torch.equal(got, w.detach()), (s, pl, (got - w).abs().max())
    # ... and our own Muon on plain tensors (W=1): the same bits
    plain, _ = _muon_run([(s, None) for s, _ in layouts], 4)
    for p, q in zip(ps, plain):
        assert torch.equal(p.full_tensor(), q.detach())
    # every global matrix is orthogonalised exactly once per step and per HSDP replica:
    # 2 HSDP matrices x 2 replicas + 6 TP matrices + 6 experts + 3 stacked TP matrices
    calls = torch.tensor([opt.ns_calls])
    torch.distributed.all_reduce(calls)
    assert int(calls) == 4 * (2 * 2 + 6 + 6 + 3), int(calls)


def case_muon_expert_stays_on_its_ep_rank(rank, world):
    """EP experts: the owner of an expert is a rank of the expert's own EP coordinate."""
    from ragged_fsdp.optim import Muon
    from ragged_fsdp.optim._gather import gather_set
    from ragged_fsdp.optim._layout import layout_of

    mesh = _mesh()
    shape, pl = MUON[8]
    p = _dist(torch.randn(shape), pl, mesh, True)
    gs = gather_set(layout_of(p))
    # the set is this rank's EP rank's dp ranks: the mesh dim "a" group, not all 4 ranks
    assert gs.world == 2 and not gs.tiled
    opt = Muon([p], lr=0.02)
    p.grad = _dist(torch.randn(shape), pl, mesh)
    opt.step()
    # 4 experts, each orthogonalised once, by a rank of its EP coordinate (mesh dim "b")
    mine = torch.zeros(2)
    mine[mesh.get_coordinate()[1]] = opt.last_step_stats["ns_matrices"]
    torch.distributed.all_reduce(mine)
    assert mine.tolist() == [2.0, 2.0], mine
    # colwise TP: one set over all four ranks, two tiles stacked on rows
    p2 = _dist(torch.randn(10, 7), MUON[2][1], mesh, True)
    gs2 = gather_set(layout_of(p2))
    assert gs2.world == 4 and sorted(set(gs2.offsets)) == [(0, 0), (5, 0)]
    p3 = _dist(torch.randn(7, 10), MUON[5][1], mesh, True)
    assert sorted(set(gather_set(layout_of(p3)).offsets)) == [(0, 0), (0, 5)]


def case_muon_state_dict_round_trip(rank, world):
    """Save after 2 steps, load under another data-parallel cut of the same TP/EP layouts
    (DTensor states and full states), continue 2 steps: equal to never stopping."""
    from ragged_fsdp.optim import Muon

    mesh = _mesh()
    la = MUON + ADAM
    lb = [(s, tuple(R(q.dims, tuple(reversed(q.local_units)), q.unit) if isinstance(q, RaggedShard) else q
                    for q in pl)) for s, pl in la]
    pa, oa = _muon_run(la, 2, mesh)
    sd = oa.state_dict()
    saved = {"param_groups": sd["param_groups"],
             "state": {k: {n: v.clone() for n, v in st.items()} for k, st in sd["state"].items()}}
    at_two = [p.full_tensor() for p in pa]
    _muon_run(la, 2, mesh, oa, pa, first=2)
    want = [p.full_tensor() for p in pa]
    for as_full in (False, True):
        pb = [_dist(x, pl, mesh, True) for x, (_, pl) in zip(at_two, lb)]
        ob = Muon(_muon_groups(pb, KW, ADAM_KW))
        ob.load_state_dict({"param_groups": saved["param_groups"],
                            "state": {k: {n: (_full(v) if as_full else v) for n, v in st.items()}
                                      for k, st in saved["state"].items()}})
        buf = ob.state[pb[2]]["momentum_buffer"]
        assert tuple(buf.placements) == tuple(lb[2][1])
        _muon_run(lb, 2, mesh, ob, pb, first=2)
        for x, y, (s, _) in zip(pb, want, lb):
            assert torch.equal(x.full_tensor(), y), (as_full, s)


def case_grouped_adamw_bitwise(rank, world):
    """ragged_fsdp.optim.AdamW on every layout: torch.optim.AdamW(foreach=False)'s bits, and a
    state dict round trip into another data-parallel cut."""
    from ragged_fsdp.optim import AdamW

    mesh = _mesh()
    layouts = MUON + ADAM
    shapes = [s for s, _ in layouts]
    init = _init(shapes, 3)
    ps = [_dist(x, pl, mesh, True) for x, (_, pl) in zip(init, layouts)]
    ref = [x.clone().requires_grad_() for x in init]
    opt = AdamW(ps, lr=1e-2, weight_decay=0.05)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.05, foreach=False)
    for step in range(3):
        _set_grads(ps, layouts, step, mesh)
        for q, g in zip(ref, _grads(shapes, step)):
            q.grad = g
        opt.step()
        ref_opt.step()
    assert opt.last_step_stats["fallback"] == 0
    for p, q, (s, pl) in zip(ps, ref, layouts):
        assert torch.equal(p.full_tensor(), q.detach()), (s, pl)
        assert torch.equal(opt.state[p]["exp_avg_sq"].full_tensor(), ref_opt.state[q]["exp_avg_sq"]), s
    lb = [(s, tuple(R(q.dims, tuple(reversed(q.local_units)), q.unit) if isinstance(q, RaggedShard) else q
                    for q in pl)) for s, pl in layouts]
    pb = [_dist(p.full_tensor(), pl, mesh, True) for p, (_, pl) in zip(ps, lb)]
    ob = AdamW(pb, lr=1e-2, weight_decay=0.05)
    ob.load_state_dict(opt.state_dict())
    for step in range(3, 5):
        _set_grads(pb, lb, step, mesh)
        for q, g in zip(ref, _grads(shapes, step)):
            q.grad = g
        ob.step()
        ref_opt.step()
    for p, q, (s, _) in zip(pb, ref, lb):
        assert torch.equal(p.full_tensor(), q.detach()), s


# -- AdamW8bit ------------------------------------------------------------------------------
A8_KW = {"lr": 1e-2, "weight_decay": 0.01, "min_8bit_size": 1000}
A8 = [
    # (shape, placements, compare with AdamW8bit on: "full" tensor or each "piece")
    ((33, 65), (Replicate(), R((0, 1), (4, 5), 256)), "full"),  # HSDP: 9 blocks, partial last
    ((16, 64), (R((0, 1), (1, 1), 256), Shard(0)), "full"),  # colwise, pieces = whole blocks
    ((40, 100), (R((0, 1), (3, 5), 256), Shard(0)), "piece"),  # colwise, 2000-element pieces
    ((30, 90), (R((0, 1), (6, 0), 256), Shard(1)), "piece"),  # rowwise, a dp rank empty
    ((4, 16, 40), (R((0, 1, 2), (2, 3), 256), Shard(0)), "piece"),  # EP experts
    ((6, 7), (R((0, 1), (10, 11)), Shard(0)), "piece"),  # small: fp32 states, cut anywhere
]


def _dp_one(pl):
    """The same TP/EP layout with every unit on the first rank of the RaggedShard's dim: what
    a data-parallel size of 1 gives."""
    out = []
    for q in pl:
        if isinstance(q, RaggedShard):
            q = R(q.dims, (sum(q.local_units),) + (0,) * (len(q.local_units) - 1), q.unit)
        out.append(q)
    return tuple(out)


def _a8_run(layouts, steps, mesh=None):
    from ragged_fsdp.optim import AdamW8bit

    shapes = [s for s, _ in layouts]
    init = _init(shapes, 11)
    ps = [_dist(x, pl, mesh, True) if pl is not None else x.clone().requires_grad_()
          for x, (_, pl) in zip(init, layouts)]
    opt = AdamW8bit(ps, **A8_KW)
    for step in range(steps):
        _set_grads(ps, layouts, step, mesh)
        opt.step()
    return ps, opt


def _outer_local(t):
    """This rank's TP/EP-local tensor of a RaggedDTensor (the RaggedShard dim gathered)."""
    from ragged_fsdp.placement.dtensor import outer_placements

    return rf.redistribute(t, t.device_mesh, outer_placements(t._spec)).to_local()


def case_adamw8bit_dp_invariant(rank, world):
    from ragged_fsdp.placement.dtensor import outer_offsets, outer_piece

    mesh = _mesh()
    layouts = [(s, pl) for s, pl, _ in A8]
    ps, opt = _a8_run(layouts, 6, mesh)
    ones, one_opt = _a8_run([(s, _dp_one(pl)) for s, pl in layouts], 6, mesh)
    full_ps, full_opt = _a8_run([(s, None) for s in [s for s, _ in layouts]], 6)
    keys8 = ("exp_avg_codes", "exp_avg_sq_codes", "exp_avg_absmax", "exp_avg_sq_absmax")
    for p, q, f, (s, pl, how) in zip(ps, ones, full_ps, A8):
        st, sq = opt.state[p], one_opt.state[q]
        # dp size 2 vs dp size 1, same TP/EP layout: parameters and every state, bitwise
        assert torch.equal(p.full_tensor(), q.full_tensor()), s
        for k in st:
            assert torch.equal(_full(st[k]), _full(sq[k])), (s, k)
        eight = "exp_avg_codes" in st
        assert eight == (_n(s) >= 1000), s
        if eight:
            absmax = st["exp_avg_absmax"]
            assert tuple(absmax.shape) == ((-(-_n(s) // 256),) if pl[0] == Replicate() else
                                           tuple(s[k] // _outer_local(p).shape[k] for k in range(len(s)))
                                           + (-(-_n(_outer_local(p).shape) // 256),)), (s, absmax.shape)
        if how == "full":  # HSDP / whole-block TP pieces: one process's bits
            assert torch.equal(p.full_tensor(), f.detach()), s
            for k in keys8:
                want = full_opt.state[f][k]
                got = _full(st[k])
                assert torch.equal(got.reshape(want.shape), want), (s, k)
            continue
        # each TP/EP-local tensor stepped alone by AdamW8bit: the same bits
        piece = outer_piece(_init([x for x, _ in layouts], 11)[layouts.index((s, pl))], p._spec).clone()
        from ragged_fsdp.optim import AdamW8bit

        ref = piece.requires_grad_()
        ref_opt = AdamW8bit([ref], **dict(A8_KW, min_8bit_size=A8_KW["min_8bit_size"] if eight else 10**9))
        for step in range(6):
            g = _grads([x for x, _ in layouts], step)[layouts.index((s, pl))]
            ref.grad = outer_piece(g, p._spec).clone()
            ref_opt.step()
        assert torch.equal(_outer_local(p), ref.detach()), (s, pl)
        rst = ref_opt.state[ref]
        if eight:
            part = tuple(o // n for o, n in zip(outer_offsets(p._spec), _outer_local(p).shape))
            for k in ("exp_avg_absmax", "exp_avg_sq_absmax"):
                assert torch.equal(st[k].full_tensor()[part], rst[k]), (s, k)
            for k in ("exp_avg_codes", "exp_avg_sq_codes"):
                assert torch.equal(_outer_local(st[k]), rst[k]), (s, k)


def case_adamw8bit_state_dict_round_trip(rank, world):
    """States saved under one dp cut load into another (DTensor and full states), bitwise;
    a state saved for another TP degree (here: one process) is refused by shape."""
    from ragged_fsdp.optim import AdamW8bit

    mesh = _mesh()
    la = [(s, pl) for s, pl, _ in A8]
    lb = [(s, _dp_one(pl)) for s, pl in la]
    pa, oa = _a8_run(la, 3, mesh)
    sd = oa.state_dict()
    full_sd = {"param_groups": sd["param_groups"],
               "state": {k: {n: _full(v) for n, v in st.items()} for k, st in sd["state"].items()}}
    for src in (sd, full_sd):
        pb = [_dist(p.full_tensor(), pl, mesh, True) for p, (_, pl) in zip(pa, lb)]
        ob = AdamW8bit(pb, **A8_KW)
        ob.load_state_dict(src)
        for p, q in zip(pb, pa):
            for k, v in ob.state[p].items():
                assert v.dtype == oa.state[q][k].dtype and torch.equal(_full(v), _full(oa.state[q][k])), k
    plain, plain_opt = _a8_run([(s, None) for s, _ in la[2:3]], 1)
    pb = [_dist(torch.zeros(la[2][0]), la[2][1], mesh, True)]
    ob = AdamW8bit(pb, **A8_KW)
    with pytest.raises(ValueError, match=r"exp_avg_absmax.*TP/EP degree"):
        ob.load_state_dict(plain_opt.state_dict())


def case_adamw8bit_cut_tp_local_block_is_an_error(rank, world):
    from ragged_fsdp.optim import AdamW8bit

    mesh = _mesh()
    p = _dist(torch.randn(40, 100), (R((0, 1), (1000, 1000)), Shard(0)), mesh, True)
    with pytest.raises(ValueError, match=r"'w'.*TP/EP-local tensor of shape \(20, 100\).*cutting a 256-element"):
        AdamW8bit([("w", p)], min_8bit_size=1000)


# -- Shampoo -------------------------------------------------------------------------------
def case_shampoo_hsdp_bitwise_and_tp_refused(rank, world):
    from ragged_fsdp.optim import ReferenceShampoo, Shampoo

    mesh = _mesh()
    kw = {"lr": 1e-2, "max_preconditioner_dim": 4, "precondition_frequency": 2}
    layouts = [((12, 10), (Replicate(), R((0,), (0, 3), 4))), ((8, 6), (Replicate(), R((0,), (1, 1), 4)))]
    init = _init([s for s, _ in layouts], 5)
    ps = [_dist(x, pl, mesh, True) for x, (_, pl) in zip(init, layouts)]
    ref = [torch.nn.Parameter(x.clone()) for x in init]
    opt, ref_opt = Shampoo(ps, **kw), ReferenceShampoo(ref, **kw)
    for step in range(4):
        _set_grads(ps, layouts, step, mesh)
        for q, g in zip(ref, _grads([s for s, _ in layouts], step)):
            q.grad = g
        opt.step()
        ref_opt.step()
    for p, q in zip(ps, ref):
        assert torch.equal(p.full_tensor(), q.detach())
    tp = _dist(torch.randn(8, 4), (R((0,), (4, 4)), Shard(1)), mesh, True)
    with pytest.raises(NotImplementedError, match=r"'wq'.*Shard\(dim=1\).*tensor or expert parallelism.*HSDP"):
        Shampoo([("wq", tp)], **kw)


def case_muon_grad_in_another_layout_is_an_error(rank, world):
    from ragged_fsdp.optim import Muon

    mesh = _mesh()
    s, pl = MUON[2]
    p = _dist(torch.randn(s), pl, mesh, True)
    opt = Muon([("w", p)], lr=0.02)
    p.grad = _dist(torch.randn(s), (R((0, 1), (35, 0)), Shard(0)), mesh)
    with pytest.raises(ValueError, match="'w'.*redistribute the gradient"):
        opt.step()


CASES = [v for k, v in sorted(globals().items()) if k.startswith("case_")]


@pytest.fixture(scope="module")
def results():
    return run_cases(WORLD, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[5:])
def test_optim_nd(results, case):
    check_case(results, case, WORLD)
