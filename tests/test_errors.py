"""Bad input gets a clear ValueError that says what is wrong, never a stack trace from inside transformers."""

import pytest
from conftest import make_drafter, make_target, random_prompt

from transformers_dflash import DFlashConfig, DFlashDraftModel


@pytest.fixture(scope="module")
def target():
    return make_target("llama")


def _generate(target, drafter, prompt=None, **kwargs):
    prompt = random_prompt(5, seed=0) if prompt is None else prompt
    return target.generate(prompt, assistant_model=drafter, max_new_tokens=5, **kwargs)


def test_hidden_size_mismatch(target):
    other = make_target("llama", hidden_size=48, head_dim=12)
    with pytest.raises(ValueError, match="hidden_size is 48 but the target's is 32"):
        _generate(target, make_drafter(other))


def test_vocab_mismatch(target):
    other = make_target("llama", vocab_size=120)
    with pytest.raises(ValueError, match="embedding table has 96 rows"):
        _generate(target, make_drafter(other))


def test_target_layer_ids_out_of_range(target):
    with pytest.raises(ValueError, match=r"target_layer_ids \[7\] are out of range"):
        _generate(target, make_drafter(target, target_layer_ids=[1, 7], num_target_layers=None))
    with pytest.raises(ValueError, match="out of range for a target with 4 layers"):
        DFlashConfig(target_layer_ids=[1, 4], num_target_layers=4)


def test_drafter_for_a_deeper_target(target):
    deeper = make_target("llama", num_layers=6)
    with pytest.raises(ValueError, match="trained for a target with 6 layers"):
        _generate(target, make_drafter(deeper, target_layer_ids=[0, 1]))


def test_mask_token_outside_the_embedding_table(target):
    drafter = make_drafter(target)
    drafter.config.mask_token_id = 96
    with pytest.raises(ValueError, match="mask_token_id=96 is not a row"):
        _generate(target, drafter)


def test_beam_search_and_several_return_sequences(target):
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match="Beam search"):
        _generate(target, drafter, num_beams=2)
    with pytest.raises(ValueError, match="num_return_sequences=2"):
        _generate(target, drafter, num_return_sequences=2, do_sample=True)


def test_non_croppable_cache(target):
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match="cannot be cropped"):
        _generate(target, drafter, cache_implementation="static")


def test_prompt_longer_than_the_drafter_context(target):
    drafter = make_drafter(target, max_position_embeddings=16)
    with pytest.raises(ValueError, match="drafter handles at most 16 positions"):
        _generate(target, drafter, prompt=random_prompt(20, seed=1))


def test_hidden_states_output_is_refused(target):
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match="output_hidden_states"):
        _generate(target, drafter, return_dict_in_generate=True, output_hidden_states=True)


def test_encoder_decoder_and_headless_targets():
    from transformers import AutoConfig, AutoModel, T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2))
    with pytest.raises(ValueError, match="decoder-only"):
        DFlashDraftModel.from_target(t5)
    headless = AutoModel.from_config(
        AutoConfig.for_model(
            "llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        )
    )
    with pytest.raises(ValueError, match="LM head"):
        DFlashDraftModel.from_target(headless)


def test_bad_configs():
    with pytest.raises(ValueError, match="block_size must be at least 2"):
        DFlashConfig(block_size=1)
    with pytest.raises(ValueError, match="num_hidden_layers must be at least 1"):
        DFlashConfig(num_hidden_layers=0)
    with pytest.raises(ValueError, match="sliding_window is not set"):
        DFlashConfig(num_hidden_layers=1, layer_types=["sliding_attention"])
    with pytest.raises(ValueError, match="one entry"):
        DFlashConfig(num_hidden_layers=2, layer_types=["full_attention"])
    with pytest.raises(ValueError, match="rope_type='spiral' is not one of transformers' RoPE types"):
        DFlashDraftModel(
            DFlashConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=2,
                rope_parameters={"rope_type": "spiral", "factor": 4.0},
            )
        )


def test_inputs_embeds_are_refused(target):
    drafter = make_drafter(target)
    embeds = target.get_input_embeddings()(random_prompt(4, seed=0))
    with pytest.raises(ValueError, match="pass input_ids instead of inputs_embeds"):
        target.generate(inputs_embeds=embeds, assistant_model=drafter, max_new_tokens=3)
