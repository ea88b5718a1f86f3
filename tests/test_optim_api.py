"""Muon and AdamW8bit in one process: plain modules, errors, policies, quality, memory.

The distributed proofs (bitwise at W = 1..4, fully_shard models) are in test_optim_dist.py.
"""

import pytest
import torch
from torch import nn

from ragged_fsdp.models.llama import Llama, LlamaConfig
from ragged_fsdp.optim import (
    AdamW8bit, Muon, combined_granularity, muon_granularity,
    muon_param_groups, newton_schulz, newton_schulz_flops, route_params, split_params, state_bytes,
)


def _model(**kw):
    torch.manual_seed(0)
    return Llama(LlamaConfig.tiny(**kw))


def _train(model, opts, steps, seed=1, batch=8, seq=33):
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, model.cfg.vocab_size, (batch, seq), generator=g)
    losses = []
    for _ in range(steps):
        loss = model.loss(tok[:, :-1], tok[:, 1:])
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
        losses.append(loss.item())
    return losses


@torch.no_grad()
def _rel(a, b, origin):
    num = sum(((x - y) ** 2).sum() for x, y in zip(a, b)).sqrt()
    den = sum(((y - o) ** 2).sum() for y, o in zip(b, origin)).sqrt()
    return float(num / den)


# -- Muon on plain modules -----------------------------------------------------------------

def test_muon_plain_module_bitwise_torch():
    """Unsharded: the same bits as torch.optim.Muon + torch.optim.AdamW on the usual split."""
    a, b = _model(), _model()
    opt = Muon(muon_param_groups(a, muon={"lr": 0.02}, adamw={"lr": 3e-3}))
    ga = muon_param_groups(b)
    ref = [torch.optim.Muon([p for _, p in ga[0]["params"]], lr=0.02),
           torch.optim.AdamW([p for _, p in ga[1]["params"]], lr=3e-3)]
    la = _train(a, [opt], 5)
    lb = _train(b, ref, 5)
    assert la == lb
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y)


def test_muon_3d_is_per_expert():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 6, 10, generator=g)
    p = w.clone().requires_grad_()
    experts = [w[k].clone().requires_grad_() for k in range(3)]
    opt = Muon([p], lr=0.02, adjust_lr_fn="match_rms_adamw")
    ref = torch.optim.Muon(experts, lr=0.02, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        grad = torch.randn(3, 6, 10, generator=g)
        p.grad = grad.clone()
        for k in range(3):
            experts[k].grad = grad[k].clone()
        opt.step()
        ref.step()
    assert torch.equal(p, torch.stack(experts))


def test_newton_schulz_orthogonalises_and_counts_flops():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 20, generator=g)
    y = newton_schulz(x).float()
    sv = torch.linalg.svdvals(y)
    assert sv.min() > 0.5 and sv.max() < 1.5  # the quintic's band, as in Muon
    assert y.shape == x.shape and x.dtype == torch.float32  # input untouched
    assert newton_schulz_flops(32, 20, 5) == 5 * 2 * (2 * 20 * 20 * 32 + 20 ** 3)
    xb = x.bfloat16()
    keep = xb.clone()
    newton_schulz(xb)
    assert torch.equal(xb, keep), "a bf16 input is not modified"


def test_muon_defaults_match_torch():
    ours = Muon([nn.Parameter(torch.zeros(2, 2))])
    theirs = torch.optim.Muon([nn.Parameter(torch.zeros(2, 2))])
    for k, v in theirs.defaults.items():
        assert ours.defaults[k] == v, k


# -- errors --------------------------------------------------------------------------------

def test_muon_rejects_1d_naming_it():
    m = _model()
    with pytest.raises(ValueError, match=r"'norm.weight' is 1-D.*use_muon=False"):
        Muon([("layers.0.attention.wq.weight", m.layers[0].attention.wq.weight), ("norm.weight", m.norm.weight)])
    with pytest.raises(ValueError, match=r"is 1-D"):
        Muon([torch.zeros(4, requires_grad=True)])
    Muon([{"params": [m.norm.weight], "use_muon": False}])  # fine on AdamW


@pytest.mark.parametrize("kw,name", [
    ({"lr": float("nan")}, "lr"), ({"weight_decay": float("inf")}, "weight_decay"),
    ({"momentum": float("nan")}, "momentum"), ({"ns_coefficients": (1.0, float("nan"), 1.0)}, r"ns_coefficients\[1\]"),
    ({"lr": -1.0}, "lr"), ({"eps": float("nan")}, "eps"),
])
def test_muon_non_finite_hyperparameters(kw, name):
    with pytest.raises(ValueError, match=rf"{name}=.*(not finite|>= 0|not a number)"):
        Muon([torch.zeros(3, 3, requires_grad=True)], **kw)


@pytest.mark.parametrize("kw,pattern", [
    ({"momentum": 1.5}, r"momentum=1.5 must be in \[0, 1\)"), ({"momentum": 1.0}, r"momentum=1.0 must be in"),
    ({"momentum": -0.1}, r"momentum=-0.1 must be >= 0"),
    ({"ns_steps": 0}, r"ns_steps=0 must be an integer in \[1, 100\)"), ({"ns_steps": 100}, r"ns_steps=100 must"),
    ({"ns_steps": 2.0}, r"ns_steps=2.0 must be an integer"), ({"ns_steps": True}, r"ns_steps=True must"),
    ({"eps": 0.0}, r"eps=0.0 must be > 0"), ({"nesterov": "yes"}, r"nesterov='yes' must be True or False"),
    ({"weight_decay": -1.0}, r"weight_decay=-1.0 must be >= 0"),
    ({"adjust_lr_fn": "rms"}, r"adjust_lr_fn='rms' must be one of"),
    ({"ns_coefficients": (1.0, 2.0)}, r"ns_coefficients=\(1.0, 2.0\) must be three numbers"),
    ({"wave_bytes": 0}, r"wave_bytes=0 must be an integer >= 1"), ({"wave_bytes": True}, r"wave_bytes=True must"),
    ({"wave_bytes": 1.5}, r"wave_bytes=1.5 must"),
])
def test_muon_out_of_range_arguments_name_the_argument(kw, pattern):
    """Muon refuses momentum=1.5 and ns_steps=0 (both would train silently wrong), naming the argument."""
    with pytest.raises(ValueError, match=pattern):
        Muon([torch.zeros(3, 3, requires_grad=True)], **kw)


def test_muon_group_override_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"param group 1: momentum=1.5 must be in \[0, 1\)"):
        Muon([{"params": [torch.zeros(3, 3, requires_grad=True)]},
              {"params": [torch.zeros(3, 3, requires_grad=True)], "momentum": 1.5}])


def test_muon_wave_bytes_same_bits_single_process():
    """W = 1: any wave size, the same bits as torch.optim.Muon; the estimate is reported."""
    torch.manual_seed(3)
    shapes = [(13, 7), (64, 48), (7, 13), (96, 32)]
    init = [torch.randn(s) for s in shapes]
    for wave_bytes in (None, 1, 8192):
        ours = [x.clone().requires_grad_() for x in init]
        ref = [x.clone().requires_grad_() for x in init]
        opt, ref_opt = Muon(ours, lr=0.02, wave_bytes=wave_bytes), torch.optim.Muon(ref, lr=0.02)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            for p, r in zip(ours, ref):
                p.grad = torch.randn(p.shape, generator=g)
                r.grad = p.grad.clone()
            opt.step()
            ref_opt.step()
        for p, r in zip(ours, ref):
            assert torch.equal(p, r), wave_bytes
        assert opt.last_step_stats["waves"] == {None: 1, 1: 4, 8192: 2}[wave_bytes]
        assert len(opt.last_step_stats["step_bytes_per_rank"]) == 1


class _VocabWideMLP(nn.Module):
    """Vocab 256 and an MLP 64 -> 256 inside the blocks."""

    def __init__(self, tie=False):
        super().__init__()
        self.emb = nn.Embedding(256, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                                    for _ in range(2))
        self.norm = nn.LayerNorm(64)
        self.proj = nn.Linear(64, 256, bias=False)
        if tie:
            self.proj.weight = self.emb.weight


def test_head_found_from_structure_not_the_vocabulary_size(caplog):
    m = _VocabWideMLP()
    hidden, rest = split_params(m)
    hn, rn = {n for n, _ in hidden}, {n for n, _ in rest}
    assert "blocks.0.0.weight" in hn and "blocks.1.0.weight" in hn  # 64 -> 256 hidden matrices stay on Muon
    assert "proj.weight" in rn and "emb.weight" in rn
    why = {n: (where, reason) for n, where, reason in route_params(m)}
    assert why["proj.weight"][0] == "adamw" and why["proj.weight"][1].startswith("head (the last Linear")
    assert why["emb.weight"] == ("adamw", "embedding") and why["norm.bias"] == ("adamw", "1-D")
    assert why["blocks.0.0.weight"] == ("muon", "2-D matrix")
    with caplog.at_level("INFO", logger="ragged_fsdp.optim"):
        muon_param_groups(m)
    assert "4 parameters to Muon" in caplog.text and "proj.weight (head" in caplog.text
    # tied: the head is the embedding's weight, found by identity
    t = _VocabWideMLP(tie=True)
    why = {n: (where, reason) for n, where, reason in route_params(t)}
    assert why["emb.weight"][0] == "adamw" and "blocks.0.0.weight" in {n for n, _ in split_params(t)[0]}


def test_ambiguous_head_refused_with_candidates():
    """Two vocabulary-sized Linears outside the blocks (two heads; a head registered before a
    vocab-wide adapter): which is the head is not guessed from the order (the first went to
    Muon before); the error lists both and how to name one, and naming them routes both to AdamW."""
    for extra, says in (("proj2", "proj2 (64 -> 256)"), ("adapter", "adapter (256 -> 256)")):
        m = _VocabWideMLP()
        setattr(m, extra, nn.Linear(64, 256) if extra == "proj2" else nn.Linear(256, 256))
        with pytest.raises(ValueError, match="head is ambiguous") as info:
            route_params(m)
        assert "proj (64 -> 256)" in str(info.value) and says in str(info.value), str(info.value)
        assert "head=model.proj" in str(info.value), str(info.value)
        with pytest.raises(ValueError, match="head is ambiguous"):
            muon_param_groups(m)
        why = {n: where for n, where, _ in route_params(m, head=[m.proj, getattr(m, extra)])}
        assert why["proj.weight"] == why[f"{extra}.weight"] == "adamw"


def test_head_of_another_model_refused():
    m, other = _VocabWideMLP(), _VocabWideMLP()
    with pytest.raises(ValueError, match="head: a Linear module is not part of this _VocabWideMLP"):
        route_params(m, head=other.proj)
    with pytest.raises(ValueError, match=r"head: a parameter of shape \(256, 64\) is not part of"):
        split_params(m, head=[m.proj, other.proj.weight])


def test_head_from_get_output_embeddings():
    class HF(_VocabWideMLP):
        def get_output_embeddings(self):
            return self.blocks[1][2]  # whatever the model says its output layer is

    m = HF()
    why = {n: (where, reason) for n, where, reason in route_params(m)}
    assert why["blocks.1.2.weight"] == ("adamw", "head (get_output_embeddings())")
    assert why["proj.weight"][0] == "muon"  # the model named another layer: no guessing on top


@pytest.mark.parametrize("kw,name", [
    ({"lr": float("nan")}, "lr"), ({"betas": (0.9, float("inf"))}, r"betas\[1\]"),
    ({"eps": float("inf")}, "eps"), ({"weight_decay": float("nan")}, "weight_decay"),
])
def test_adamw8bit_non_finite_hyperparameters(kw, name):
    with pytest.raises(ValueError, match=rf"{name}=.*not finite"):
        AdamW8bit([torch.zeros(3, 3, requires_grad=True)], **kw)


def test_non_finite_lr_from_a_schedule_is_caught_at_step():
    p = torch.zeros(64, 64, requires_grad=True)
    for opt in (Muon([p]), AdamW8bit([p])):
        p.grad = torch.ones(64, 64)
        opt.param_groups[0]["lr"] = float("nan")
        with pytest.raises(ValueError, match="lr=nan is not finite"):
            opt.step()


def test_adamw_group_of_muon_validates_betas():
    with pytest.raises(ValueError, match=r"betas\[0\]=1.5"):
        Muon([{"params": [torch.zeros(3, requires_grad=True)], "use_muon": False, "betas": (1.5, 0.9)}])


# -- granularity policies and routing -------------------------------------------------------

def test_granularity_policies():
    from ragged_fsdp.planner import Granularity

    mat, experts, vec = torch.zeros(8, 4), torch.zeros(5, 6, 7), torch.zeros(9)
    assert Muon.granularity("w", mat) == "tensor"
    assert Muon.granularity("e", experts) == "rows:6"
    assert Muon.granularity("b", vec) is None
    # rows:H on (E, H, I) keeps one whole (H, I) expert matrix per block
    assert Granularity.parse(Muon.granularity("e", experts)).block_elems(experts.shape) == 6 * 7
    assert AdamW8bit.granularity("w", torch.zeros(64, 64)) == "block:256"
    assert AdamW8bit.granularity("w", torch.zeros(63, 64)) is None
    assert AdamW8bit.granularity_for(128, 100)("w", torch.zeros(10, 10)) == "block:128"
    assert Granularity.parse("block:256").block_elems((64, 64)) == 256
    assert muon_granularity is Muon.granularity


def test_split_and_combined_policy():
    m = _model()
    hidden, rest = split_params(m)
    hn = {n for n, _ in hidden}
    rn = {n for n, _ in rest}
    assert "tok_embeddings.weight" in rn and "output.weight" in rn and "norm.weight" in rn
    assert "layers.0.attention.wq.weight" in hn and "layers.1.feed_forward.w2.weight" in hn
    assert not any(n.endswith("norm.weight") for n in hn)
    pol = combined_granularity(m)
    assert pol("tok_embeddings.weight", m.tok_embeddings.weight) == "block:256"
    assert pol("x", m.layers[0].attention.wq.weight) == "tensor"
    assert pol("x", m.norm.weight) is None
    # explicit head, tied embeddings
    tied = _model(tie_embeddings=True)
    hidden, rest = split_params(tied)
    assert tied.output.weight is tied.tok_embeddings.weight
    assert not any(p is tied.output.weight for _, p in hidden)
    hidden, rest = split_params(m, head=[m.layers[0].attention.wq])
    assert "layers.0.attention.wq.weight" in {n for n, _ in rest}
    assert "output.weight" in {n for n, _ in hidden}  # an explicit head replaces the default
    groups = muon_param_groups(m, muon={"lr": 0.02}, adamw={"lr": 1e-3})
    assert [g["use_muon"] for g in groups] == [True, False]


# -- AdamW8bit: plain modules, quality, memory, state dicts ---------------------------------

def test_adamw8bit_state_layout_and_dtypes():
    w = torch.zeros(64, 129, requires_grad=True)  # 8256 elements: 32 blocks + one of 64
    b = torch.zeros(100, requires_grad=True)
    opt = AdamW8bit([w, b])
    w.grad, b.grad = torch.randn(64, 129), torch.randn(100)
    opt.step()
    s = opt.state[w]
    assert s["exp_avg_codes"].dtype == torch.uint8 and s["exp_avg_codes"].shape == w.shape
    assert s["exp_avg_sq_codes"].dtype == torch.uint8
    assert s["exp_avg_absmax"].dtype == torch.float32 and s["exp_avg_absmax"].shape == (33,)
    assert set(opt.state[b]) == {"step", "exp_avg", "exp_avg_sq"}
    assert opt.state[b]["exp_avg"].dtype == torch.float32


def test_adamw8bit_quality_20_steps():
    """Training the tiny LLaMA for 20 steps: parameters within 5% (relative to the distance
    travelled) of fp32 AdamW; bitsandbytes' 8-bit AdamW (if importable) lands as close."""
    cfg = dict(dim=64, ffn_hidden=176, vocab_size=128)
    m32, m8 = _model(**cfg), _model(**cfg)
    origin = [p.detach().clone() for p in m32.parameters()]
    l32 = _train(m32, [torch.optim.AdamW(m32.parameters(), lr=3e-3)], 20)
    l8 = _train(m8, [AdamW8bit(m8.parameters(), lr=3e-3)], 20)
    rel = _rel(list(m8.parameters()), list(m32.parameters()), origin)
    assert rel < 0.05, rel
    assert abs(l8[-1] - l32[-1]) / l32[-1] < 0.02
    try:
        import bitsandbytes as bnb
    except Exception:
        return
    mb = _model(**cfg)
    _train(mb, [bnb.optim.AdamW8bit(mb.parameters(), lr=3e-3)], 20)
    rel_b = _rel(list(mb.parameters()), list(m32.parameters()), origin)
    assert rel < 1.5 * rel_b + 0.01, (rel, rel_b)
    assert _rel(list(m8.parameters()), list(mb.parameters()), origin) < 0.05


def test_adamw8bit_memory_ratio_mixed_sizes():
    """State memory on a model of mixed sizes (matrices, vectors, small tensors): <= 0.27x."""
    m = _model(dim=128, ffn_hidden=344, vocab_size=512, n_layers=2)
    sizes = sorted({p.numel() for p in m.parameters()})
    assert sizes[0] < 4096 <= sizes[-1]  # mixed: some keep fp32 states
    o8, o32 = AdamW8bit(m.parameters()), torch.optim.AdamW(m.parameters())
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    o8.step()
    o32.step()
    ratio = state_bytes(o8) / state_bytes(o32)
    assert ratio <= 0.27, ratio


def test_adamw8bit_bf16_params():
    p = torch.randn(64, 64).bfloat16().requires_grad_()
    opt = AdamW8bit([p], lr=1e-2)
    for _ in range(3):
        p.grad = torch.randn(64, 64).bfloat16()
        opt.step()
    assert p.dtype == torch.bfloat16 and torch.isfinite(p).all()


@pytest.mark.parametrize("make", [
    lambda ps: AdamW8bit(ps, lr=1e-2, min_8bit_size=1024),
    lambda ps: Muon([{"params": [p for p in ps if p.dim() >= 2]},
                     {"params": [p for p in ps if p.dim() < 2], "use_muon": False}], lr=0.02),
], ids=["adamw8bit", "muon"])
def test_state_dict_round_trip_plain(make):
    a = _model()
    opt = make(list(a.parameters()))
    _train(a, [opt], 3)
    sd = opt.state_dict()
    b = _model()
    b.load_state_dict(a.state_dict())
    opt_b = make(list(b.parameters()))
    opt_b.load_state_dict(sd)
    for st_a, st_b in zip(opt.state.values(), opt_b.state.values()):
        for k in st_a:
            assert st_a[k].dtype == st_b[k].dtype and torch.equal(st_a[k], st_b[k]), k
    la = _train(a, [opt], 3, seed=5)
    lb = _train(b, [opt_b], 3, seed=5)
    assert la == lb
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y)
