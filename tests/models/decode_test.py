"""Decoding with a KV cache (issue 45): each step's logits are a full forward pass's over the
same tokens, batched prompts of different lengths, greedy and sampled, deterministic by seed.
The model is training's (`llama.create_model`), its params the Llama tests' (one init program)."""

import jax
import numpy as np
import pytest
from helpers import integers, llama_config

from mptrain.models import decoder as llama
from mptrain.models.decoder import decode
from mptrain.parallel import sharding

STEPS = 16
# Two prompts of 25 and 32 tokens: with 16 steps the full sequences are the [2, 48] of the Llama
# tests, whose forward program the check below shares (make test counts its compiles).
PROMPTS = [integers(2, (25,), 64).tolist(), integers(3, (32,), 64).tolist()]


def _model(**overrides):
    return llama.create_model(llama_config(**overrides))


@pytest.fixture(scope="module")
def scanned():
    """The model and the params tests/models/llama_test.py initialises (the same program)."""
    model = _model()
    tokens = integers(1, (2, 48), 64)
    return model, jax.jit(model.init)(jax.random.key(0), tokens)["params"]


def _check_steps_against_a_full_forward(model, params):
    prompts, lengths = decode.pad_prompts(PROMPTS, model.max_len, STEPS)
    run = decode.make_decoder(model, STEPS, keep_logits=True, keep_logps=True)
    greedy, none = decode.Sampling().values(), decode.stops([])
    tokens, logits, _ = run(params, prompts, lengths, greedy, 0, none)
    tokens, logits = np.asarray(tokens), np.asarray(logits)
    assert (tokens >= 0).all()  # no stop token: every row runs all its steps
    # each row's prompt and what it generated, right-padded: one causal forward pass
    full = np.zeros((len(PROMPTS), prompts.shape[1] + STEPS), np.int32)
    for b, n in enumerate(lengths):
        full[b, : n + STEPS] = np.concatenate([prompts[b, :n], tokens[b]])
    want = np.asarray(jax.jit(model.apply)({"params": params}, full))
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(logits[:, b], want[b, n - 1 : n - 1 + STEPS], atol=2e-5)
        np.testing.assert_array_equal(tokens[b], want[b, n - 1 : n - 1 + STEPS].argmax(-1))
    return tokens


def test_each_cached_step_gives_the_logits_of_a_full_forward_pass(scanned):
    """fp32, scanned layers, grouped queries (4 over 1), Llama 3's RoPE scaling, prompts of 25
    and 32 tokens in one batch: at every one of 16 steps, each row's logits are the full
    forward pass's at that position, past the original context (32) too."""
    model, params = scanned
    _check_steps_against_a_full_forward(model, params)


@pytest.mark.slow  # the unscanned layout's second decoder and forward program
def test_the_unscanned_layout_decodes_the_same_tokens(scanned):
    model, params = scanned
    tokens = _check_steps_against_a_full_forward(model, params)
    flat = _model(scan_layers=False)
    layers = {
        f"layers_{i}": jax.tree.map(lambda a, i=i: a[i], params[sharding.STACKED]) for i in range(2)
    }
    params_flat = {k: v for k, v in params.items() if k != sharding.STACKED} | layers
    np.testing.assert_array_equal(_check_steps_against_a_full_forward(flat, params_flat), tokens)


def test_sampling_is_the_same_for_a_seed_and_stops_at_a_stop_token(scanned):
    """Temperature, top-k and top-p are run-time values of one compiled decoder: a seed gives
    the same tokens twice, another seed others; greedy is argmax; a stop token ends its row."""
    model, params = scanned
    prompts, lengths = decode.pad_prompts(PROMPTS, model.max_len, STEPS)
    keep = decode.make_decoder(model, STEPS, keep_logits=True, keep_logps=True)  # as above
    run = lambda *args: keep(*args)[0]
    hot, none = (
        decode.Sampling(temperature=1.5, top_k=20, top_p=0.95).values(),
        decode.stops([]),
    )
    one, again = (np.asarray(run(params, prompts, lengths, hot, 7, none)) for _ in range(2))
    np.testing.assert_array_equal(one, again)
    # each drawn token's log-probability, over the whole vocabulary at the temperature (before
    # top-k and top-p): what GRPO holds against the trainer's (issue 71)
    _, logits, logps = (np.asarray(x) for x in keep(params, prompts, lengths, hot, 7, none))
    scaled = np.swapaxes(logits, 0, 1) / 1.5
    full = scaled - jax.scipy.special.logsumexp(scaled, axis=-1, keepdims=True)
    want = np.take_along_axis(full, one[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(logps, want, rtol=0, atol=1e-5)
    assert not np.array_equal(one, np.asarray(run(params, prompts, lengths, hot, 8, none)))
    stop = int(one[1, 3])  # a token row 1 draws at its fourth step: the same draws stop there
    stopped = np.asarray(run(params, prompts, lengths, hot, 7, decode.stops([stop])))
    for row, was in zip(stopped.tolist(), one.tolist(), strict=True):
        end = was.index(stop) + 1 if stop in was else len(was)
        assert row[:end] == was[:end] and set(row[end:]) <= {decode.PAD}, (row, was)
    assert decode.strip(stopped, [stop])[1] == one[1, : one[1].tolist().index(stop)].tolist()
    # top-k of 1, or a top-p below the largest probability, leave only the argmax: greedy
    greedy = np.asarray(run(params, prompts, lengths, decode.Sampling().values(), 0, none))
    for top_k, top_p in ((1, 1.0), (0, 1e-6)):
        values = decode.Sampling(temperature=2.0, top_k=top_k, top_p=top_p).values()
        for seed in range(2):
            np.testing.assert_array_equal(run(params, prompts, lengths, values, seed, none), greedy)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"temperature": -1.0}, "--temperature=-1.0"),
        ({"top_k": -2}, "--top_k=-2"),
        ({"top_p": 0.0}, "--top_p=0.0"),
    ],
)
def test_bad_sampling_settings_name_the_flag(kwargs, says):
    with pytest.raises(ValueError, match=says):
        decode.Sampling(**kwargs)


def test_a_prompt_past_the_context_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"prompt 1 has 60 tokens: with --max_new_tokens=8"):
        decode.pad_prompts([[1, 2], [3] * 60], max_len=64, max_new_tokens=8)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        decode.pad_prompts([[]], max_len=64, max_new_tokens=8)


@pytest.mark.parametrize("targets", [None, "attn/(q|v)"])
def test_the_unrolled_layers_keep_the_adapters_the_scanned_stack_has(targets):
    """A LoRA run's decoder (samples, GRPO's sampler) unrolls the scanned layers: each unrolled
    layer's projections adapt as the stack's did (a stack's target `attn/q` is `layers_1/attn/q`
    unrolled; before, the unrolled layers dropped every adapter of a `lora.targets` run and of
    GRPO's default, which names every projection)."""
    from mptrain import config as config_lib
    from mptrain import models

    base = config_lib.base_config()
    base.lora.rank, base.lora.targets = 4, targets
    from mptrain.parallel import axes as axes_lib

    model = models.create(llama_config(), config_lib.policy_of(base), lora=base.lora)
    tokens = jax.ShapeDtypeStruct((1, 4), np.int32)
    params = jax.eval_shape(lambda t: model.init(jax.random.key(0), t), tokens)["params"]
    made = {}

    def unroll(params):  # traced only: nothing compiles
        made["model"], params = decode.unscanned(model, params)
        return params

    jax.eval_shape(unroll, axes_lib.unboxed(params))
    unrolled = made["model"].lora
    for name in ("q", "v", "k"):
        want = model.lora.adapts(("attn", name))
        assert unrolled.adapts(("layers_1", "attn", name)) == want, name
    assert want is (targets is None)  # k: adapted only where every projection is
