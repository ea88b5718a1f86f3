"""HF ``Trainer`` on a tiny Llama, the same 3 steps in one process (the reference: no FSDP)
or on every rank of a launch with ragged_fsdp through accelerate's FSDP2 path
(``tests/test_integration_accelerate.py::case_hf_trainer``).

The sampler is sequential so that step k sees rows [4k, 4k + 4) whatever the world size
(accelerate hands rank r the r-th batch of ``4 // W`` rows of each step), and every row has
the same number of labels, so the mean of the ranks' mean losses is the one-process mean.

    python tests/_hf_trainer.py OUT_DIR     # the one-process reference, written to OUT_DIR/reference.pt
"""

from __future__ import annotations

import os
import sys

import torch

GLOBAL_BATCH = 4
STEPS = 3


def _model():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg)


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n: int = GLOBAL_BATCH * STEPS, seq: int = 16, vocab: int = 96):
        self.x = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def train(out_dir: str, world: int, fsdp: bool) -> dict:
    """Train and return the logged losses and gradient norms and the full final parameters."""
    import transformers
    from torch.distributed.tensor import DTensor

    class InOrder(transformers.Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    kw = dict(output_dir=out_dir, use_cpu=True, max_steps=STEPS, per_device_train_batch_size=GLOBAL_BATCH // world,
              learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1, report_to=[], save_strategy="no",
              seed=0, dataloader_num_workers=0, disable_tqdm=True)
    if fsdp:
        kw.update(fsdp="full_shard auto_wrap",
                  fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "reshard_after_forward": True})
    args = transformers.TrainingArguments(**kw)
    trainer = InOrder(model=_model(), args=args, train_dataset=_Rows())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for n, p in trainer.model.named_parameters()}
    import ragged_fsdp

    return {"loss": [h["loss"] for h in logs], "grad_norm": [h["grad_norm"] for h in logs], "params": params,
            "ragged": isinstance(trainer.model, ragged_fsdp.FSDPModule)}


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = sys.argv[1]
    torch.save(train(out, 1, fsdp=False), os.path.join(out, "reference.pt"))
