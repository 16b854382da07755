"""`dflash train --init-from-target`: a new drafter's layers start as the target's last layers."""

import pytest
import torch
from test_training import read_log, small_config, tiny_target, write_shards
from transformers import Gemma2Config, Gemma2ForCausalLM

from transformers_dflash import DFlashDraftModel
from transformers_dflash.training import train
from transformers_dflash.training.target_init import init_from_target_layers

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


def test_copied_layers_compute_what_the_targets_last_layers_compute():
    target = tiny_target(num_layers=4)
    drafter = DFlashDraftModel.from_target(target, num_layers=2, block_size=4, target_layer_ids=[0, 1])
    calibration = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(0))
    assert init_from_target_layers(drafter, target, calibration) == [2, 3]

    decoder = target.get_decoder()
    assert torch.equal(drafter.norm.weight, decoder.norm.weight)
    assert torch.equal(drafter.hidden_norm.weight, decoder.layers[2].input_layernorm.weight)
    # fc passes the deepest feature (layer 1's output, the input of layer 2) through and drops the other one
    features = torch.randn(1, 3, 2 * 64)
    assert torch.allclose(drafter.fc(features), features[..., 64:])
    # the target has no q/k norms: they start at the target's own per-head scale on the calibration text, one value
    # per layer, measured on what the copied layer reads there (the target's hidden_states[source])
    with torch.no_grad():
        hidden_states = decoder(input_ids=calibration, output_hidden_states=True).hidden_states
    for layer, source in zip(drafter.layers, (2, 3)):
        theirs = decoder.layers[source]
        for norm, projection in (
            (layer.self_attn.q_norm, theirs.self_attn.q_proj),
            (layer.self_attn.k_norm, theirs.self_attn.k_proj),
        ):
            per_head = projection(theirs.input_layernorm(hidden_states[source])).unflatten(
                -1, (-1, drafter.config.head_dim)
            )
            expected = per_head.pow(2).mean(-1).sqrt().mean()
            assert norm.weight.min() == norm.weight.max() > 0
            torch.testing.assert_close(norm.weight[0], expected, rtol=1e-5, atol=1e-6)
    # On one token, attention is its own value whatever q and k are, so a copied layer must compute exactly what
    # the target's layer computes: projections, MLP, norms and residuals all came over.
    hidden = torch.randn(1, 1, 64)
    position_ids = torch.tensor([[5]])
    no_context = hidden.new_zeros(1, 0, 64)
    with torch.no_grad():
        for drafter_layer, source in zip(drafter.layers, (2, 3)):
            ours = drafter_layer(hidden, no_context, drafter.rotary_emb(hidden, position_ids))
            theirs = decoder.layers[source](
                hidden, position_ids=position_ids, position_embeddings=decoder.rotary_emb(hidden, position_ids)
            )
            theirs = theirs[0] if isinstance(theirs, tuple) else theirs
            torch.testing.assert_close(ours, theirs)


def test_training_from_the_target_starts_there_and_logs_it(tmp_path):
    target = tiny_target(num_layers=4)
    write_shards(tmp_path / "data", target, num_examples=8, per_shard=4)
    # lr 0: the saved drafter is the initialised one
    config = small_config(tmp_path, tmp_path / "data", tmp_path / "out", init_from_target=True, lr=0.0, max_steps=1)
    train(config, target)
    drafter = DFlashDraftModel.from_pretrained(tmp_path / "out")
    assert torch.equal(drafter.layers[0].mlp.up_proj.weight, target.get_decoder().layers[3].mlp.up_proj.weight)
    assert read_log(tmp_path / "out")[0]["config"]["init_from_target"] is True

    both = small_config(tmp_path, tmp_path / "data", tmp_path / "both", init_from_target=True, init_drafter="x")
    with pytest.raises(ValueError, match="--init-drafter and --init-from-target .* keep one"):
        train(both, target)


def test_targets_whose_layers_differ_are_refused():
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )
    gemma = Gemma2ForCausalLM(config).eval()
    drafter = DFlashDraftModel.from_target(gemma, num_layers=1, block_size=4, target_layer_ids=[0])
    # Gemma 2 has extra norms around its MLP and scales its norms by 1 + weight: refused, not half-copied
    before = {name: value.clone() for name, value in drafter.state_dict().items()}
    with pytest.raises(ValueError, match="--init-from-target: .*Train from random weights"):
        init_from_target_layers(drafter, gemma, torch.randint(3, 96, (1, 8)))
    assert all(torch.equal(value, before[name]) for name, value in drafter.state_dict().items())

    target = tiny_target(num_layers=2)
    drafter = DFlashDraftModel.from_target(target, num_layers=3, block_size=4, target_layer_ids=[0])
    with pytest.raises(ValueError, match="the drafter has 3 layers and the target only 2"):
        init_from_target_layers(drafter, target, torch.randint(3, 96, (1, 8)))
