"""A MoE layer as it runs: router, token permutation, grouped expert GEMMs at their per-rank
shapes, and the dispatch / combine all-to-all over the EP group.

- Routing imbalance ``imbalance`` = tokens on the most loaded EP rank / the mean. The step
  waits for that rank, so its expert GEMMs (:func:`.compute.group_flops`) and the bytes it
  receives scale by it. Default :data:`DEFAULT_IMBALANCE`; torchtitan's published MoE
  points force balanced routing (``debug_moe_force_load_balance``) and are simulated at 1.0.
- Permutation: torchtitan's dispatcher gathers each routed token copy into expert order
  before the grouped GEMM and scatters the outputs back, summing the ``top_k`` copies with
  their weights: per MoE layer and forward, read + write of the routed copies twice
  (permute, unpermute) = ``4 x tokens x top_k x hidden x cb`` bytes; backward twice that.
  Router: the ``hidden x E`` GEMM is a linear (:mod:`.compute`); softmax / top-k / the
  scores' gather move ``tokens x E`` fp32 values a few times (``ROUTER_PASSES``).
- All-to-all: each rank sends ``tokens x top_k x hidden x cb x imbalance`` bytes per dispatch
  (``1/ep`` of them stay local) and as many back per combine; forward dispatch + combine,
  backward the same reversed, and again in forward's recomputation under full activation
  checkpointing (per-op SAC saves the all-to-all outputs, torchtitan's policy). Intra-node
  over NVLink, across nodes through each rank's NIC (:func:`.comm.alltoall_time`).
  ``standard`` (torchtitan's default: ``all_to_all_single`` after a device-to-host copy of
  the split sizes, run on the compute stream, never overlapped) reaches ``A2A_EFFICIENCY
  ["standard"]`` of the link bandwidth, fitted on one published point (:mod:`.fitted`);
  ``deepep`` sends a token once to every rank that holds at least one of its ``top_k``
  experts (its dispatch layout is per rank, ``is_token_in_rank``; the combine reduces the
  copies on their rank before sending back), not once per expert: with the experts spread
  evenly, ``ep x (1 - C(E - E/ep, k) / C(E, k))`` ranks per token on average
  (:func:`deepep_ranks_per_token`; Qwen3-30B-A3B at EP 8: 5.36, against 8 copies). It
  reaches :func:`deepep_efficiency` of the link: on Hopper 0.95, DeepEP's published
  normal-kernel bottleneck bandwidth (153 / 158 GB/s of H800's ~160 GB/s NVLink at EP 8,
  43-58 GB/s of a 50 GB/s CX7 NIC at EP 16-64; deepseek-ai/DeepEP README); on Blackwell
  NVLink 0.557, torchtitan's own tuned B200 EP-8 measurement (dispatch 516.71 GB/s, combine
  485.75 GB/s of 900 GB/s; ``torchtitan/distributed/deepep/utils.py`` at 366776a, the
  configuration of the published DeepEP runs). Neither is fitted here.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import fitted
from .comm import alltoall_time
from .profiles import GPUProfile

__all__ = ["DISPATCHERS", "DEFAULT_IMBALANCE", "ROUTER_PASSES", "MoECost", "a2a_bytes", "moe_layer_cost",
           "a2a_calls", "deepep_ranks_per_token", "deepep_efficiency", "deepep_buffer_bytes"]

DISPATCHERS = ("standard", "deepep")
# most loaded EP rank / mean; an assumption (not calibrated): aux-loss-free balanced routing
# (DeepSeek-V3's) keeps experts' per-batch load close to the mean, not equal to it
DEFAULT_IMBALANCE = 1.1
ROUTER_PASSES = 6  # fp32 passes over tokens x E scores: softmax/sigmoid (2), top-k (2), gather (2)
DEEPEP_EFFICIENCY = 0.95  # Hopper (and across nodes): DeepEP README
# Blackwell NVLink: mean of torchtitan's tuned B200 EP-8 dispatch / combine over 900 GB/s
DEEPEP_EFFICIENCY_BLACKWELL_NVLINK = (516.71 + 485.75) / 2 / 900
BLACKWELL = ("b200", "b200-1000w", "gb200")


@dataclass
class MoECost:
    permute_f: float  # seconds per MoE layer, forward (permutation + router elementwise)
    permute_b: float
    a2a_call: float  # seconds of one dispatch (or combine) on this rank
    a2a_bytes: float  # bytes this rank sends per call


def a2a_bytes(tokens: float, top_k: int, hidden: int, cb: float, imbalance: float = 1.0) -> float:
    """Bytes one rank hands to one dispatch (or receives from one combine): every routed copy
    of its tokens, the most loaded rank's share. ``1/ep`` of them stay local."""
    return tokens * top_k * hidden * cb * imbalance


def a2a_calls(act_ckpt: str) -> float:
    """Dispatch + combine calls per MoE layer per microbatch: forward 2, backward 2, and
    forward's recomputation under full (2) or layer-selective (every other block: 1) AC."""
    return 4.0 + {"full": 2.0, "selective": 1.0}.get(act_ckpt, 0.0)


def deepep_ranks_per_token(top_k: int, experts: int, ep: int) -> float:
    """Expected number of EP ranks a token is dispatched to when its ``top_k`` distinct
    experts are drawn uniformly from ``experts`` spread evenly over ``ep`` ranks: ``ep``
    times the chance a rank holds at least one of them (hypergeometric)."""
    if ep <= 1 or not experts:
        return float(min(top_k, 1))
    local = experts / ep
    miss = 1.0
    for i in range(top_k):
        miss *= max(0.0, (experts - local - i) / (experts - i))
    return min(float(top_k), ep * (1.0 - miss))  # never more ranks than copies


def deepep_efficiency(prof: GPUProfile, ep: int, stride: int = 1) -> float:
    """DeepEP's achieved fraction of the bottleneck link (see the module docstring)."""
    intra = ep * stride <= prof.gpus_per_node
    return DEEPEP_EFFICIENCY_BLACKWELL_NVLINK if (intra and prof.name in BLACKWELL) else DEEPEP_EFFICIENCY


# DeepEP's NVLink buffer (``Config.get_nvl_buffer_size_hint``, deepseek-ai/DeepEP
# ``csrc/config.hpp``): per channel (``num_sms / 2``) and NVLink peer, a ring of
# ``recv_tokens`` slots of the hidden bytes plus 128 top-k indices (int64), 128 weights and
# 128 scales (fp32). torchtitan sizes it with DeepEP's default config for the EP degree
# (``get_buffer`` in ``torchtitan/distributed/deepep/fused_a2a.py``; EP <= 8: 256 slots)
# and runs 128 SMs (``turbo_deepep_num_cus``, its tuned EP-8 value), one buffer per process.
DEEPEP_NUM_SMS = 128
DEEPEP_MAX_NVL_PEERS = 8  # DeepEP's NUM_MAX_NVL_PEERS
DEEPEP_NVL_RECV_TOKENS = 256
DEEPEP_SLOT_META_BYTES = 128 * 8 + 128 * 4 + 128 * 4


def deepep_buffer_bytes(hidden: int, cb: float, ep: int, gpus_per_node: int) -> float:
    """Bytes of DeepEP's NVLink communication buffer on one rank (intra-node part; the RDMA
    buffer of EP across nodes is not modelled)."""
    if ep <= 1:
        return 0.0
    peers = min(ep, gpus_per_node, DEEPEP_MAX_NVL_PEERS)
    hidden_bytes = hidden * max(cb, 2)
    return DEEPEP_NUM_SMS / 2 * peers * DEEPEP_NVL_RECV_TOKENS * (hidden_bytes + DEEPEP_SLOT_META_BYTES)


def moe_layer_cost(prof: GPUProfile, tokens: float, top_k: int, experts: int, hidden: int, cb: float, ep: int,
                   dispatcher: str, imbalance: float, stride: int = 1) -> MoECost:
    copies = tokens * top_k * hidden * cb * (imbalance if ep > 1 else 1.0)
    router = ROUTER_PASSES * tokens * experts * 4
    pf = (4 * copies + router) / prof.mem_bw
    copies_sent = deepep_ranks_per_token(top_k, experts, ep) if dispatcher == "deepep" else top_k
    nb = a2a_bytes(tokens, copies_sent, hidden, cb, imbalance) if ep > 1 else 0.0
    eff = deepep_efficiency(prof, ep, stride) if dispatcher == "deepep" else fitted.A2A_EFFICIENCY["standard"]
    call = alltoall_time(prof, nb, ep, stride) / eff if nb else 0.0
    return MoECost(pf, 2 * pf, call, nb)
