"""QLoRA through accelerate 1.15 and through transformers' ``Trainer`` with
``ragged_fsdp.integrations.accelerate.enable()`` (2 gloo CPU ranks, one launch): a tiny Llama
loaded 4-bit (NF4, bf16 quant storage, double quantisation) with peft LoRA on every linear.
Each path trains 2 steps; the losses are compared with the same model in one process, the
bases must be sharded as whole-block 4-bit weights, and the state dict must carry
bitsandbytes' statistic keys. The bounds are float rounding of the 2-rank gradient mean.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from _dist import check_case, run_cases

pytest.importorskip("accelerate")
pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
pytest.importorskip("transformers")

WORLD = 2
VOCAB = 128
SEQ = 9


def _save_base(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)


def _load():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_quant_storage=torch.bfloat16,
                           bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32)
    m = AutoModelForCausalLM.from_pretrained(os.environ["BNB4_HF_BASE"], quantization_config=q, dtype=torch.float32)
    torch.manual_seed(1)
    return get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                        init_lora_weights="gaussian")).train()  # from_pretrained: eval mode


def _data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (2 * WORLD, SEQ), generator=g)


def _labels(x):
    # -100 first: the causal shift drops it, and Trainer's token count (labels != -100, before
    # the shift) is then the number of targets, so its loss is the plain mean
    y = x.clone()
    y[:, 0] = -100
    return y


def _reference(steps, lr, weight_decay=0.01, labels=lambda x: x):
    ref = _load()
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)
    out = []
    for s in range(steps):
        x = _data(s)
        loss = ref(x, labels=labels(x)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _check_sharded(model):
    from ragged_fsdp.quant.bnb4 import BnB4Weight

    n = 0
    for name, mod in model.named_modules():
        if type(mod).__name__ == "Linear4bit" and hasattr(mod, "weight") and not hasattr(mod, "base_layer"):
            assert isinstance(mod.weight.to_local(), BnB4Weight), name
            n += 1
    assert n == 14, n
    sd = model.state_dict()
    stats = [k for k in sd if k.endswith(".weight.nested_absmax")]
    assert len(stats) == 14, len(stats)


def _fresh_state(rank, world):
    from accelerate.state import AcceleratorState, GradientState

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def case_accelerate(rank, world):
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    import ragged_fsdp.integrations.accelerate as ragged_accelerate

    want = _reference(2, 1e-2)
    _fresh_state(rank, world)
    ragged_accelerate.enable()
    try:
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"], reshard_after_forward=True)
        acc = Accelerator(fsdp_plugin=plugin, cpu=True)
        model = _load()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model, opt = acc.prepare(model, opt)
        _check_sharded(model)
        got = []
        for s in range(2):
            x = _data(s).chunk(world)[rank]
            loss = model(x, labels=x).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            lt = loss.detach().clone()
            dist.all_reduce(lt)
            got.append(lt.item() / world)
    finally:
        ragged_accelerate.disable()
    for a, b in zip(got, want):
        assert abs(a - b) <= 2e-6 * abs(b), (got, want)


def case_trainer(rank, world):
    from transformers import Trainer, TrainingArguments

    import ragged_fsdp.integrations.accelerate as ragged_accelerate

    want = _reference(2, 1e-2, weight_decay=0.0, labels=_labels)
    data = [{"input_ids": x, "labels": y} for s in range(2) for x, y in zip(_data(s), _labels(_data(s)))]
    _fresh_state(rank, world)
    ragged_accelerate.enable()
    os.environ["FSDP_VERSION"] = "2"  # transformers 4.57.1 reads it, not fsdp_config["fsdp_version"]
    try:
        args = TrainingArguments(
            output_dir=os.environ["BNB4_HF_OUT"], per_device_train_batch_size=2, max_steps=2, learning_rate=1e-2,
            lr_scheduler_type="constant", optim="adamw_torch", weight_decay=0.0, warmup_steps=0, logging_steps=1,
            save_strategy="no", report_to=[], use_cpu=True, dataloader_drop_last=True, seed=0,
            fsdp="full_shard auto_wrap",
            # cpu_ram_efficient_loading and sync_module_states at their defaults: they run on CPU too
            fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "reshard_after_forward": True},
            max_grad_norm=0.0, remove_unused_columns=False)

        class Ordered(torch.utils.data.Dataset):
            def __len__(self):
                return len(data)

            def __getitem__(self, i):
                return data[i]

        trainer = Trainer(model=_load(), args=args, train_dataset=Ordered())
        # in order: accelerate then gives rank r every 2nd batch of 2 from r on, so each step's
        # 2 x 2 rows are the reference's batch of 4
        trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(Ordered())
        out = trainer.train()
        _check_sharded(trainer.model_wrapped if hasattr(trainer, "model_wrapped") else trainer.model)
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    finally:
        ragged_accelerate.disable()
    assert len(losses) == 2, trainer.state.log_history
    # Trainer logs the mean loss rounded to 4 digits
    for a, b in zip(losses, want):
        assert abs(a - b) <= 1e-4 + 2e-6 * abs(b), (losses, want)
    assert out.global_step == 2


CASES = [case_accelerate, case_trainer]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("bnb4hf")
    _save_base(str(root / "base"))
    os.environ["BNB4_HF_BASE"] = str(root / "base")
    os.environ["BNB4_HF_OUT"] = str(root / "out")
    return run_cases(WORLD, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_case(results, case):
    check_case(results, case, WORLD)
