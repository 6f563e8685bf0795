"""A Llama-style model loaded in 4-bit through transformers' BitsAndBytesConfig (random weights
saved offline), its Linear4bit layers routed through the kernel: bitsandbytes' logits, every layer
on the launch-plan fast path, on one GPU and split over two."""

import pytest
import torch

import bench.model
from nf4_triton import dropin, kernel

pytestmark = pytest.mark.gpu

TINY = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    pytest.importorskip("transformers")
    folder = str(tmp_path_factory.mktemp("tiny-llama"))
    bench.model.SIZES["tiny"] = TINY
    try:
        bench.model.save_random_llama("tiny", folder, vocab_size=1000)
    finally:
        del bench.model.SIZES["tiny"]
    return folder


def logits_and_fast_path(model):
    """Logits of a 4x512 prefill (above bitsandbytes' fused-kernel rows), routed, after a warm-up
    call that leaves one launch plan per layer; the measured call keeps none (a layer that took the
    validating path would have kept a new one)."""
    layers = 2 * 7
    ids = torch.randint(0, 1000, (4, 512), device=model.device, generator=torch.Generator(model.device).manual_seed(0))
    with torch.inference_mode():
        expected = model(ids).logits
        assert dropin.enable(model) == layers
        kept = kernel.PLANS.stats()["kept"]
        model(ids)
        assert kernel.PLANS.stats()["kept"] - kept == layers
        got = model(ids).logits
        assert kernel.PLANS.stats()["kept"] - kept == layers, "a layer missed its plan"
    dropin.disable(model)
    return expected, got


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_logits_equal_bitsandbytes(saved_model, dtype):
    model = bench.model.load_4bit(saved_model, dtype)
    expected, got = logits_and_fast_path(model)
    assert torch.equal(got, expected)


@pytest.mark.gpu(2)
def test_model_split_over_two_gpus(saved_model):
    """device_map puts layer 0 on cuda:0 and layer 1 on cuda:1: whichever device is current,
    each layer launches on its own and stays on the fast path."""
    device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1,
                  "model.rotary_emb": 0, "lm_head": 1}
    model = bench.model.load_4bit(saved_model, torch.bfloat16, device_map=device_map)
    devices = {layer.weight.device.index for layer in bench.model.linear4bit_layers(model)}
    assert devices == {0, 1}
    with torch.cuda.device(0):
        expected, got = logits_and_fast_path(model)
    assert torch.equal(got, expected)
