"""Single-process Shampoo written straight from the algorithm text of issue 11 (no sharding,
no code shared with :mod:`ragged_fsdp.optim.shampoo`), to check the distributed one against.

Plain tensors only. Per parameter, the tiles of its merged view each keep Kronecker factors
``F_j``, inverse roots ``P_j``; the parameter keeps the grafting moments ``m`` and ``v`` (fp32)
and one step count. Operation order is fixed (the distributed optimizer must produce the
same bits): pointwise grafting on the whole tensor, then tile by tile on contiguous copies.
"""

from __future__ import annotations

import torch

__all__ = ["ReferenceShampoo"]


def _merge(shape, B):
    dims = [d for d in shape if d != 1] or [1]
    out = [dims[-1]]
    for d in dims[-2::-1]:
        if out[-1] * d <= B:
            out[-1] *= d
        else:
            out.append(d)
    return out[::-1]


def _tile_slices(merged, B):
    slices = [[]]
    for d in merged:
        slices = [s + [slice(a, min(a + B, d))] for s in slices for a in range(0, d, B)]
    return [tuple(s) for s in slices] if all(merged) else []


def _bias(beta, t):
    return 1.0 - torch.tensor(beta, dtype=torch.float32) ** t if beta < 1.0 else 1.0


class ReferenceShampoo:
    """Unsharded Shampoo on plain parameters; same arguments as ``Shampoo``."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), epsilon=1e-12, weight_decay=0.0,
                 max_preconditioner_dim=1024, precondition_frequency=1, start_preconditioning_step=-1,
                 use_bias_correction=True, grafting_type="adam", grafting_beta2=0.999,
                 grafting_epsilon=1e-8, factor_matrix_dtype=torch.float32):
        self.params = list(params)
        self.lr, self.betas, self.eps, self.wd = lr, betas, epsilon, weight_decay
        self.B, self.freq = max_preconditioner_dim, precondition_frequency
        self.start = precondition_frequency if start_preconditioning_step == -1 else start_preconditioning_step
        self.bias, self.graft = use_bias_correction, grafting_type
        self.gb2, self.geps, self.fdt = grafting_beta2, grafting_epsilon, factor_matrix_dtype
        self.t = 0
        self.state = []
        for p in self.params:
            merged = _merge(p.shape, self.B)
            tiles = []
            for sl in _tile_slices(merged, self.B):
                dims = [s.stop - s.start for s in sl]
                tiles.append({"slices": sl,
                              "F": [torch.zeros(d, d, dtype=self.fdt, device=p.device) for d in dims],
                              "P": [torch.eye(d, dtype=self.fdt, device=p.device) for d in dims]})
            self.state.append({"merged": merged, "tiles": tiles,
                               "m": torch.zeros(p.shape, dtype=torch.float32, device=p.device),
                               "v": torch.zeros(p.shape, dtype=torch.float32, device=p.device)})

    @torch.no_grad()
    def step(self):
        self.t += 1
        t = self.t
        beta1, beta2 = self.betas
        bc1 = _bias(beta1, t) if self.bias else 1.0
        bc2 = _bias(beta2, t) if self.bias else 1.0
        recompute = t == self.start or (t > self.start and t % self.freq == 0)
        for p, st in zip(self.params, self.state):
            if p.grad is None:
                continue
            G = p.grad.float().reshape(st["merged"])
            X = p.detach().float().reshape(st["merged"])
            m, v = st["m"].view(st["merged"]), st["v"].view(st["merged"])
            # 3.-5. grafting on the whole tensor
            if self.graft == "adam":
                v.mul_(self.gb2).addcmul_(G, G, value=1 - self.gb2)
            elif self.graft == "adagrad":
                v.addcmul_(G, G)
            m.lerp_(G, 1 - beta1)
            m_hat = m / bc1
            if self.graft == "adam":
                A = m_hat / ((v / _bias(self.gb2, t)).sqrt() + self.geps)
            elif self.graft == "adagrad":
                A = m_hat / (v.sqrt() + self.geps)
            else:
                A = m_hat
            D = A.clone() if t < self.start else torch.empty_like(A)
            for tile in st["tiles"]:
                sl, k = tile["slices"], len(tile["slices"])
                g = G[sl].contiguous()
                for j in range(k):  # 1. factors
                    rest = [i for i in range(k) if i != j]
                    tile["F"][j].mul_(beta2).add_(torch.tensordot(g, g, (rest, rest)).to(self.fdt), alpha=1 - beta2)
                if recompute:  # 2. inverse roots
                    for j in range(k):
                        a = tile["F"][j] / bc2 + self.eps * torch.eye(g.shape[j], dtype=self.fdt, device=g.device)
                        lam, q = torch.linalg.eigh(a)
                        lmin = lam.min()
                        if lmin < self.eps:
                            lam = lam - lmin + self.eps
                        r = (q * lam.pow(-1.0 / (2 * k)).unsqueeze(0)) @ q.T
                        tile["P"][j] = r.triu() + r.triu(1).T
                if t >= self.start:  # 6. precondition, graft per tile
                    s = m_hat[sl].contiguous().to(self.fdt)
                    for j in range(k):
                        s = torch.tensordot(s, tile["P"][j], ([0], [0]))
                    s = s.float()
                    if self.graft is not None:
                        s = s * (torch.linalg.vector_norm(A[sl].contiguous()) / (torch.linalg.vector_norm(s) + 1e-16))
                    D[sl] = s
            D.add_(X, alpha=self.wd)  # 7. decoupled weight decay, update
            X.add_(D, alpha=-self.lr)
            p.copy_(X.view(p.shape))
