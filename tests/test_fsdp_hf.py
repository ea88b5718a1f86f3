"""Unmodified Hugging Face transformers models under ragged fully_shard equal single-process
training (tiny local configs, no downloads): Llama with tied embeddings, and Mixtral (MoE).
Skipped when transformers is not installed."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from _dist import check_case, compare_training, run_cases  # noqa: E402

from ragged_fsdp.fsdp import fully_shard  # noqa: E402


def _llama():
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(cfg)


def _mixtral():
    cfg = transformers.MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=16, num_experts_per_tok=2,
        tie_word_embeddings=False, attn_implementation="sdpa", router_aux_loss_coef=0.0,
    )
    return transformers.MixtralForCausalLM(cfg)


def _wrap(model, mesh):
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _loss(model, tokens, targets):
    return model(input_ids=tokens, labels=tokens).loss


def case_hf_llama_tied(rank, world):
    def check(step, model, ref):
        assert model.lm_head.weight is model.model.embed_tokens.weight

    compare_training(rank, world, _llama, _wrap, loss_fn=_loss, vocab=96, steps=3, after_step=check)


def case_hf_mixtral(rank, world):
    compare_training(rank, world, _mixtral, _wrap, loss_fn=_loss, vocab=96, steps=3, batch_per_rank=1, seq=8)


CASES = [case_hf_llama_tied, case_hf_mixtral]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"W{w}")
def results(request):
    return run_cases(request.param, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.removeprefix("case_"))
def test_hf_model_matches_single_process(results, case):
    check_case(results, case)
