"""What the engine relies on from torch's private calls, pinned on every torch CI runs.

``ragged_fsdp.fsdp.torch_private`` is the one place the engine reaches torch's private API:
the saved-tensor hook stack and reference counts (``fsdp/core/backward.py``'s watch uses them
to free the root's embedding buffer after forward, free its norm + head at their early
reduction, and keep the watch off while a wrapped block runs forward; ``fsdp/comms/custom.py``
counts a custom comm's tensor's references before adopting its memory), the version counter
the collectives put back after writing into the parameters' memory, and whether autograd runs
a backward (activation-checkpoint recomputation, the trace's ``backward`` flag). The first
tests check each function's contract in this process, through the seam function alone; the
distributed cases (gloo, W = 2, one launch) check what the watch gets from them. A failure
names the seam function and the behaviour that changed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

from _dist import check_case, run_cases
from _patterns import _ce, _tiny, _wrap_blocks, compare_steps

from ragged_fsdp.fsdp import torch_private as tp
from ragged_fsdp.models.llama import Llama

SEAM = "ragged_fsdp.fsdp.torch_private"


_USERS = {"set_version_counter": "the collectives in fsdp/comms/ rely",
          "graph_task_id": "fsdp/core/ and fsdp/tracing.py rely (through in_backward)",
          "in_backward": "fsdp/core/ and fsdp/tracing.py rely"}


def _broke(fn: str, what: str) -> str:
    users = _USERS.get(fn, "the saved-tensor watch in fsdp/core/backward.py relies")
    return f"{SEAM}.{fn} on torch {torch.__version__}: {what}. {users} on it; adapt {fn} to this torch."


class _Pair:
    """A pack/unpack pair that counts what it packed."""

    def __init__(self):
        self.packed = 0

    def pack(self, t):
        self.packed += 1
        return t

    def unpack(self, t):
        return t


def _saves():
    a = torch.ones(3, requires_grad=True)
    return a * a  # mul saves both operands


# -- each function's contract, in this process -----------------------------------------------
def test_hook_stack_top_push_pop():
    assert tp.saved_tensors_hooks_top() is None, _broke("saved_tensors_hooks_top", "not None with no hooks pushed")
    w = _Pair()
    tp.push_saved_tensors_hooks(w.pack, w.unpack)
    try:
        top = tp.saved_tensors_hooks_top()
        assert top is not None and top[0].__self__ is w and top[1].__self__ is w, _broke(
            "saved_tensors_hooks_top", f"returned {top!r}, not the pair just pushed")
        _saves()
        assert w.packed == 2, _broke("push_saved_tensors_hooks", f"the pushed pack hook saw {w.packed} of 2 saves")
    finally:
        tp.pop_saved_tensors_hooks()
    assert tp.saved_tensors_hooks_top() is None, _broke("pop_saved_tensors_hooks", "the pair is still on top")
    _saves()
    assert w.packed == 2, _broke("pop_saved_tensors_hooks", "a popped pack hook still sees saves")


def test_hook_stack_shared_with_public_hooks_and_popped_out_of_order():
    """Activation checkpointing's hooks (``saved_tensors_hooks``) are seen on top; the watch
    is popped from above them and pushed back (a nested group's pause) while they stay."""
    foreign, w = _Pair(), _Pair()
    with saved_tensors_hooks(foreign.pack, foreign.unpack):
        top = tp.saved_tensors_hooks_top()
        assert top is not None and top[0].__self__ is foreign, _broke(
            "saved_tensors_hooks_top", "does not see hooks pushed by torch.autograd.graph.saved_tensors_hooks")
        tp.push_saved_tensors_hooks(w.pack, w.unpack)
        tp.pop_saved_tensors_hooks()  # paused
        top = tp.saved_tensors_hooks_top()
        assert top is not None and top[0].__self__ is foreign, _broke(
            "pop_saved_tensors_hooks", "the hooks under the popped pair are not on top again")
        _saves()
        tp.push_saved_tensors_hooks(w.pack, w.unpack)  # resumed
        _saves()
        tp.pop_saved_tensors_hooks()
        assert (foreign.packed, w.packed) == (2, 2), _broke(
            "push_saved_tensors_hooks", f"packs seen (foreign, watch) = {(foreign.packed, w.packed)}, expected (2, 2)")
    assert tp.saved_tensors_hooks_top() is None, _broke("pop_saved_tensors_hooks", "the stack is not empty again")


def test_push_refused_under_disabled_hooks():
    w = _Pair()
    with torch.autograd.graph.disable_saved_tensors_hooks("disabled by the user"):
        assert tp.push_saved_tensors_hooks(w.pack, w.unpack) is False, _broke(
            "push_saved_tensors_hooks", "did not report a push refused under disable_saved_tensors_hooks")
    assert tp.saved_tensors_hooks_top() is None, _broke("push_saved_tensors_hooks", "a refused push left a pair")


def test_use_counts_grow_while_autograd_saves():
    buf = torch.zeros(4 * 3 + 5)  # an unsharded buffer; the parameters are leaf views of it
    p = buf[:12].view(4, 3).requires_grad_()
    q = buf[12:].requires_grad_()
    x = torch.randn(2, 3, requires_grad=True)
    s0, p0, q0 = tp.storage_use_count(buf), tp.tensor_use_count(p), tp.tensor_use_count(q)
    assert s0 >= 3, _broke("storage_use_count", f"count {s0} for a storage three tensors view")
    assert p0 >= 1, _broke("tensor_use_count", f"count {p0} for a tensor that exists")

    y = x @ p.t()  # mm saves a view of p: a new tensor on the buffer's storage
    assert tp.storage_use_count(buf) > s0, _broke(
        "storage_use_count", "did not grow while autograd holds a saved view of the storage")
    del y
    assert tp.storage_use_count(buf) == s0, _broke("storage_use_count", "did not fall back once the graph was freed")

    y = x[:, :1] * q  # mul saves q itself
    assert tp.tensor_use_count(q) > q0, _broke(
        "tensor_use_count", "did not grow while autograd holds the tensor itself (saved by mul)")
    assert tp.storage_use_count(buf) == s0, _broke(
        "storage_use_count", "grew when autograd saved a tensor itself, not a new view")
    del y
    assert tp.tensor_use_count(q) == q0 and tp.tensor_use_count(p) == p0, _broke(
        "tensor_use_count", "did not fall back once the graph was freed")


def test_storage_use_count_same_for_any_sole_tensor():
    """``fsdp/comms/custom.py`` adopts a custom comm's tensor's memory only when its count is
    that of a fresh tensor one local holds: the same for every such tensor, higher with a view."""
    a, b = torch.empty(1), torch.empty(7)
    n = tp.storage_use_count(a)
    assert tp.storage_use_count(b) == n, _broke(
        "storage_use_count", f"two tensors held alike count {n} and {tp.storage_use_count(b)}")
    v = b[1:]
    assert tp.storage_use_count(b) > n, _broke("storage_use_count", "did not grow when a view of the storage exists")
    del v
    assert tp.storage_use_count(b) == n, _broke("storage_use_count", "did not fall back when the view went")


def _gathered_into(restore: bool):
    """An unsharded buffer whose view autograd saved, written in place under no_grad (what a
    collective does); with ``restore``, its version counter is put back through the seam."""
    out = torch.zeros(6)
    w = out[:3]  # a parameter: a view of the unsharded buffer
    x = torch.randn(3, requires_grad=True)
    v = out._version
    y = (x * w).sum()  # mul saves w
    with torch.no_grad():
        out.copy_(torch.arange(6.0))
    assert out._version > v  # the write moved the counter (else this test checks nothing)
    if restore:
        tp.set_version_counter((out,), (v,))
        assert out._version == v and w._version == v, _broke(
            "set_version_counter", f"versions (buffer, view) = {(out._version, w._version)}, expected ({v}, {v})")
    return x, y, out


def test_set_version_counter_hides_the_write_from_autograd():
    x, y, out = _gathered_into(restore=True)
    try:
        y.backward()
    except RuntimeError as e:
        raise AssertionError(_broke("set_version_counter", f"autograd still saw the in-place write: {e}")) from e
    assert torch.equal(x.grad, out[:3]), _broke(
        "set_version_counter", "backward did not read the values written into the buffer")
    _, y, _ = _gathered_into(restore=False)  # the control: without the restore autograd refuses
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_graph_task_id_outside_and_inside_backward():
    assert tp.graph_task_id() == -1, _broke("graph_task_id", f"{tp.graph_task_id()} outside backward, not -1")
    assert tp.in_backward() is False, _broke("in_backward", "True outside backward")
    seen = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            seen["forward"] = (tp.graph_task_id(), tp.in_backward())
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            seen["node"] = (tp.graph_task_id(), tp.in_backward())
            return g

    def hook(g):
        seen["hook"] = (tp.graph_task_id(), tp.in_backward())

    x = torch.ones(2, requires_grad=True)
    h = Probe.apply(x * 2)
    h.register_hook(hook)
    h.sum().backward()
    assert seen["forward"] == (-1, False), _broke("graph_task_id", f"{seen['forward']} in forward")
    for where in ("hook", "node"):
        gid, inside = seen[where]
        assert gid != -1, _broke("graph_task_id", f"-1 inside a backward {where}")
        assert inside is True, _broke("in_backward", f"False inside a backward {where}")
    assert tp.graph_task_id() == -1, _broke("graph_task_id", "not -1 again after backward")


def test_in_backward_during_checkpoint_recomputation():
    """Non-reentrant activation checkpointing runs the forward again inside backward: the
    engine's forward hooks tell it from the first run by ``in_backward``."""
    runs = []

    def block(t):
        runs.append(tp.in_backward())
        return t.sin() * 2

    x = torch.randn(3, requires_grad=True)
    checkpoint(block, x, use_reentrant=False).sum().backward()
    assert runs == [False, True], _broke("in_backward", f"(first run, recomputation) saw {runs}, expected [False, True]")


def test_preserve_version_counter_keeps_the_version_through_writes():
    x = torch.ones(4, requires_grad=True)
    buf = torch.zeros(4)
    w = buf[:2]
    y = (x[:2] * w).sum()  # autograd saves the view w
    v = buf._version
    with torch.no_grad(), tp.preserve_version_counter(buf):
        buf.copy_(torch.arange(4.0))  # the collective's write
        buf.add_(1)
    assert buf._version == v and w._version == v, _broke(
        "preserve_version_counter", f"versions (buffer, view) = {(buf._version, w._version)}, expected ({v}, {v})")
    y.backward()
    assert torch.equal(x.grad[:2], torch.tensor([1.0, 2.0])), _broke(
        "preserve_version_counter", "backward did not read the values written inside the block")


def test_swap_storage_exchanges_memory_and_keeps_views():
    assert tp.has_swap_storage(), _broke("swap_storage", "torch.UntypedStorage._swap_data_ptr_ is gone")
    a, b = torch.zeros(6), torch.arange(6.0)
    view_a = a[2:5]  # made before the swap, as the unsharded parameters are views of the flat buffer
    sa, sb = a.untyped_storage(), b.untyped_storage()
    tp.swap_storage(sa, sb)
    assert torch.equal(a, torch.arange(6.0)) and torch.equal(b, torch.zeros(6)), _broke(
        "swap_storage", f"after the swap a = {a.tolist()}, b = {b.tolist()}")
    assert torch.equal(view_a, torch.tensor([2.0, 3.0, 4.0])), _broke(
        "swap_storage", f"a view made before the swap reads {view_a.tolist()}, not b's old values")
    assert a.untyped_storage()._cdata == sa._cdata, _broke("swap_storage", "a's storage changed identity")


@pytest.mark.parametrize("fn, owner, name, args", [
    ("set_version_counter", "torch._C._autograd", "_unsafe_set_version_counter", lambda: ((torch.zeros(1),), (0,))),
    ("graph_task_id", "torch._C", "_current_graph_task_id", lambda: ()),
    ("in_backward", "torch._C", "_current_graph_task_id", lambda: ()),
    ("storage_use_count", "torch._C", "_storage_Use_Count", lambda: (torch.zeros(1),)),
    ("preserve_version_counter", "torch.autograd", "_unsafe_preserve_version_counter", lambda: (torch.zeros(1),)),
    ("swap_storage", "torch.UntypedStorage", "_swap_data_ptr_",
     lambda: (torch.zeros(1).untyped_storage(), torch.zeros(1).untyped_storage())),
])
def test_missing_private_call_is_named(monkeypatch, fn, owner, name, args):
    try:
        monkeypatch.delattr(f"{owner}.{name}")
    except AttributeError:  # defined on a C base class (UntypedStorage's methods): shadow it with None
        monkeypatch.setattr(f"{owner}.{name}", None)
    with pytest.raises(tp.TorchPrivateMissing, match=rf"torch_private\.{fn if fn != 'in_backward' else 'graph_task_id'}: .*{name}"):
        getattr(tp, fn)(*args())


def test_missing_private_call_is_named_and_the_watch_stays_off(monkeypatch):
    """A torch without the stack's top: the seam names the call, and the watch does not start
    (nothing is skipped or freed early: the safe branch)."""
    from ragged_fsdp.fsdp.core.backward import start_watch

    monkeypatch.delattr(torch._C._autograd, "_top_saved_tensors_default_hooks")
    with pytest.raises(tp.TorchPrivateMissing, match="torch_private.saved_tensors_hooks_top"):
        tp.saved_tensors_hooks_top()
    assert start_watch({}, []) is None


# -- what the engine gets from them (gloo, W = 2) --------------------------------------------
def _step(m, t, y, distributed):
    _ce(m(t), y).backward()


def _forward_frees(tr, buffer):
    return [e for e in tr.of("free", buffer=buffer) if not e.backward]


def case_watch_frees_embedding_and_head(rank, world):
    """The root's embedding buffer is freed after forward and not gathered in backward; its
    norm + head buffer is freed right before its early reduction; the root's watch is off the
    stack while a block runs forward and back on it for the norm."""
    from ragged_fsdp.fsdp import trace

    seen = {}

    def top_at(where):
        def hook(module, args):
            seen.setdefault(where, tp.saved_tensors_hooks_top())
        return hook

    def wrap(m, mesh):
        m.layers[0].attention.register_forward_pre_hook(top_at("block"))
        m = _wrap_blocks(m, mesh)
        m.norm.register_forward_pre_hook(top_at("norm"))
        return m

    with trace() as tr:
        compare_steps(rank, world, lambda: Llama(_tiny()), wrap, _step, steps=1)
    emb, head = tr.buffer_of("tok_embeddings.weight"), tr.buffer_of("output.weight")
    assert _forward_frees(tr, emb), (
        f"the root's embedding buffer was not freed after forward: the saved-tensor watch learned nothing "
        f"(check {SEAM}.saved_tensors_hooks_top / push / pop)\n{tr.table()}")
    assert not [e for e in tr.of("all_gather", buffer=emb) if e.backward], tr.table()
    ev = [e for e in tr if e.backward]
    k = next(i for i, e in enumerate(ev) if e.kind == "reduce_scatter" and e.buffer == head)
    assert ev[k].early and ev[k - 1].kind == "free" and ev[k - 1].buffer == head, (
        f"the root's norm + head were not freed at their early reduction (check {SEAM})\n{tr.table()}")
    assert seen["block"] is None, (
        f"the root's watch stayed on the hook stack while a block ran forward: {SEAM}.pop_saved_tensors_hooks "
        f"or saved_tensors_hooks_top changed ({seen['block']!r})")
    assert seen["norm"] is not None, f"the root's watch was not pushed back after the blocks ({SEAM})"


class _PeekingBlock(nn.Module):
    """A block that also saves a detached view of the root's embedding weight (only the
    storage's count shows it) and the root's norm weight itself (only the tensor's count
    shows it), both reached outside the module tree."""

    def __init__(self, block, root):
        super().__init__()
        self.block = block
        self._root = [root]

    def forward(self, h, cos, sin):
        root = self._root[0]
        w = root.tok_embeddings.weight.detach()
        return self.block(h, cos, sin) + 0.01 * F.linear(h @ w.t(), w.t()) + 0.01 * h * root.norm.weight


class _PeekingLlama(Llama):
    def __init__(self, cfg, before_blocks_backward):
        super().__init__(cfg)
        self.layers = nn.ModuleList(_PeekingBlock(b, self) for b in self.layers)
        self._check = [before_blocks_backward]

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        if h.requires_grad:  # runs once the norm + head finished backward, before any block's
            h.register_hook(lambda g: self._check[0]())
        return self.output(self.norm(h))


def case_saved_inside_a_block_is_kept(rank, world):
    """What a block saves of the root's units while the root's watch is paused shows in the
    reference counts: the embedding stays gathered after forward, and the norm + head are
    reduced early but not freed (the blocks' backward still reads the norm weight)."""
    from ragged_fsdp.fsdp import trace

    checked = []

    def root_units_kept():
        # checked before the blocks' backward reads what they saved (freed, it would crash)
        checked.append(True)
        assert not [e for e in tr if e.kind == "free" and not e.backward and "tok_embeddings.weight" in e.params], (
            f"the root freed its embedding buffer after a block saved a view of it: {SEAM}.storage_use_count "
            f"no longer grows when autograd saves a view of the storage\n{tr.table()}")
        assert not [e for e in tr if e.kind == "free" and e.backward and "output.weight" in e.params], (
            f"the root freed its norm + head after a block saved the norm weight: {SEAM}.tensor_use_count "
            f"no longer grows when autograd saves a tensor itself\n{tr.table()}")

    with trace() as tr:
        compare_steps(rank, world, lambda: _PeekingLlama(_tiny(), root_units_kept), _wrap_blocks, _step,
                      steps=1)
    assert len(checked) == 2, checked  # the reference's backward and the wrapped model's
    head = tr.buffer_of("output.weight")
    assert [e for e in tr.of("reduce_scatter", buffer=head) if e.early], tr.table()


class _CheckpointedEmbedding(Llama):
    def forward(self, tokens):
        h = checkpoint(self.tok_embeddings, tokens, use_reentrant=False) * 1.0
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))


def case_checkpoint_hooks_seen(rank, world):
    """Under activation checkpointing's hooks the watch cannot see the saves: the embedding
    stays gathered (its recomputation reads the weight)."""
    from ragged_fsdp.fsdp import trace

    with trace() as tr:
        compare_steps(rank, world, lambda: _CheckpointedEmbedding(_tiny()), _wrap_blocks, _step, steps=1)
    emb = tr.buffer_of("tok_embeddings.weight")
    assert not _forward_frees(tr, emb), (
        f"the embedding was freed after a forward run under a checkpoint's hooks: {SEAM}.saved_tensors_hooks_top "
        f"no longer shows hooks pushed by torch.autograd.graph.saved_tensors_hooks\n{tr.table()}")


def case_forward_with_saved_tensor_hooks_disabled(rank, world):
    """A step under ``disable_saved_tensors_hooks``: the watch stays off (the embedding is
    kept for backward) and training matches one process."""
    from ragged_fsdp.fsdp import trace

    def step(m, t, y, distributed):
        with torch.autograd.graph.disable_saved_tensors_hooks("disabled by the user"):
            _ce(m(t), y).backward()

    with trace() as tr:
        compare_steps(rank, world, lambda: Llama(_tiny()), _wrap_blocks, step, steps=1)
    assert not _forward_frees(tr, tr.buffer_of("tok_embeddings.weight")), tr.table()


CASES = [case_watch_frees_embedding_and_head, case_checkpoint_hooks_seen, case_forward_with_saved_tensor_hooks_disabled,
         case_saved_inside_a_block_is_kept]


@pytest.fixture(scope="module")
def results():
    return run_cases(2, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_engine(results, case):
    check_case(results, case, 2)
