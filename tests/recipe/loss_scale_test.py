import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from mptrain.recipe import loss_scale


def _reference_adjust(s, finite):
    """The rule of docs/design.md (Megatron-LM's and DeepSpeed's), in plain Python: the oracle."""
    s = dict(s)
    if finite:
        s["counter"] += 1
        if s["counter"] >= s["growth_interval"]:
            grown = min(s["scale"] * s["growth_factor"], s["max_scale"])
            s["scale"] = grown if np.isfinite(grown) else s["scale"]
            s["counter"] = 0
            s["left"] = s["hysteresis"]  # hysteresis refills on growth, and only then
    else:
        s["counter"] = 0
        s["left"] = max(s["left"] - 1, 0)
        if s["left"] == 0:  # spent: every overflow backs off until the scale grows again
            s["scale"] = max(s["min_scale"], s["scale"] * s["backoff_factor"])
    return s


def _megatron_trajectory(pattern, scale, interval, hysteresis, growth=2.0, backoff=0.5):
    """Megatron-LM's DynamicGradScaler.update as documented, restated (no clamps in play)."""
    growth_tracker, hysteresis_tracker, out = 0, hysteresis, []
    for finite in pattern:
        if not finite:
            growth_tracker, hysteresis_tracker = 0, hysteresis_tracker - 1
            if hysteresis_tracker <= 0:
                scale *= backoff
        else:
            growth_tracker += 1
            if growth_tracker == interval:
                growth_tracker, hysteresis_tracker, scale = 0, hysteresis, scale * growth
        out.append(scale)
    return out


def _deepspeed_trajectory(pattern, scale, window, hysteresis, factor=2.0):
    """DeepSpeed's DynamicLossScaler.update_scale (consecutive_hysteresis=False), restated:
    growth every `window` iterations counted from the last overflow."""
    cur_hysteresis, last_overflow, out = hysteresis, -1, []
    for it, finite in enumerate(pattern):
        if not finite:
            if hysteresis == 1 or cur_hysteresis == 1:
                scale /= factor
            else:
                cur_hysteresis -= 1
            last_overflow = it
        elif (it - last_overflow) % window == 0:
            cur_hysteresis, scale = hysteresis, scale * factor
        out.append(scale)
    return out


def _bursty(seed, n=400):
    """Finite runs long enough to grow, and overflow bursts of 1-6 steps, isolated or not."""
    rng = np.random.default_rng(seed)
    pattern = []
    while len(pattern) < n:
        pattern += [True] * int(rng.integers(1, 20)) + [False] * int(rng.integers(1, 7))
    return pattern[:n]


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_bursty_trajectory_matches_megatron_and_deepspeed(hysteresis):
    pattern = _bursty(hysteresis)
    scaler = loss_scale.DynamicLossScale(
        scale=2.0**15, growth_interval=4, hysteresis=hysteresis, min_scale=2.0**-60,
        max_scale=2.0**60,
    )  # fmt: skip
    adjust = jax.jit(lambda s, f: s.adjust(f))
    ours = []
    for finite in pattern:
        scaler = adjust(scaler, jnp.asarray(finite))
        ours.append(float(scaler.loss_scale))
    assert ours == _megatron_trajectory(pattern, 2.0**15, 4, hysteresis)
    assert ours == _deepspeed_trajectory(pattern, 2.0**15, 4, hysteresis)
    # Inside a burst, once hysteresis is spent, every overflow backs off (not every other one).
    burst = [True] * 3 + [False] * 5
    scaler, scales = loss_scale.DynamicLossScale(1024.0, growth_interval=100, hysteresis=2), []
    for finite in burst:
        scaler = scaler.adjust(finite)
        scales.append(float(scaler.loss_scale))
    assert scales == [1024.0] * 4 + [512.0, 256.0, 128.0, 64.0]


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_dynamic_rule_under_jit_matches_the_design(hysteresis):
    kw = dict(growth_interval=3, growth_factor=4.0, backoff_factor=0.25, min_scale=2.0)
    kw |= dict(max_scale=2.0**10, hysteresis=hysteresis)
    scaler = loss_scale.DynamicLossScale(scale=16.0, **kw)
    ref = dict(scale=16.0, counter=0, left=hysteresis, **kw)
    adjust = jax.jit(lambda s, f: s.adjust(f))
    # Long finite runs (to hit max_scale) and bursts of overflow (to hit min_scale).
    pattern = [True] * 20 + [False] * 12 + _bursty(hysteresis, 200) + [True] * 30
    for finite in pattern:
        scaler = adjust(scaler, jnp.asarray(finite))
        ref = _reference_adjust(ref, bool(finite))
        assert float(scaler.loss_scale) == ref["scale"]
        assert int(scaler.counter) == ref["counter"]
        assert int(scaler.hysteresis_left) == ref["left"]
        assert 2.0 <= float(scaler.loss_scale) <= 2.0**10
    # The hyperparameters came through every jit call unchanged.
    assert float(scaler.min_scale) == 2.0 and float(scaler.max_scale) == 2.0**10
    assert int(scaler.hysteresis) == hysteresis and int(scaler.growth_interval) == 3


def test_hysteresis_two_tolerates_an_isolated_overflow():
    scaler = loss_scale.DynamicLossScale(scale=1024.0, hysteresis=2)
    once = scaler.adjust(False)
    assert float(once.loss_scale) == 1024.0
    assert float(once.adjust(False).loss_scale) == 512.0
    # a finite step in between does not refill hysteresis (only growth does)
    assert float(once.adjust(True).adjust(False).loss_scale) == 512.0


def test_growth_never_goes_non_finite():
    scaler = loss_scale.DynamicLossScale(scale=2.0**120, growth_interval=1, growth_factor=2.0**10)
    scaler = scaler.replace(max_scale=jnp.asarray(jnp.inf, jnp.float32))
    grown = jax.jit(lambda s: s.adjust(True))(scaler)
    assert float(grown.loss_scale) == 2.0**120  # 2**130 would be inf in fp32: kept


def _assert_same(a, b):
    assert type(a) is type(b)
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


CUSTOM = dict(
    scale=64.0,
    growth_interval=7,
    growth_factor=3.0,
    backoff_factor=0.125,
    min_scale=4.0,
    max_scale=512.0,
    hysteresis=2,
)


@pytest.mark.parametrize(
    "scaler",
    [
        loss_scale.DynamicLossScale(**CUSTOM).adjust(False),
        loss_scale.StaticLossScale(128.0),
        loss_scale.NoOpLossScale(),
    ],
    ids=["dynamic", "static", "noop"],
)
def test_every_field_survives_tree_map_jit_and_orbax(scaler, tmp_path):
    _assert_same(jax.tree.map(lambda x: x, scaler), scaler)
    _assert_same(jax.jit(lambda s: s)(scaler), scaler)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ls", {"ls": scaler})
        ckpt.wait_until_finished()
        restored = ckpt.restore(tmp_path / "ls", {"ls": scaler})["ls"]
    _assert_same(restored, scaler)


def test_fields_are_fp32_and_int32_arrays():
    scaler = loss_scale.DynamicLossScale(**CUSTOM)
    assert scaler.loss_scale.dtype == jnp.float32 and scaler.min_scale.dtype == jnp.float32
    assert scaler.counter.dtype == jnp.int32 and scaler.hysteresis_left.dtype == jnp.int32
    assert int(scaler.hysteresis_left) == 2


def test_scale_is_fp32_so_a_scaled_fp16_loss_cannot_overflow():
    loss16 = jnp.asarray(10.0, jnp.float16)
    scaled = loss_scale.DynamicLossScale(scale=2.0**15).scale(loss16)
    assert scaled.dtype == jnp.float32 and float(scaled) == 10.0 * 2.0**15
    with np.errstate(over="ignore"):  # what scaling in fp16 would have done:
        assert not np.isfinite(np.float16(10.0) * np.float16(2.0**15))


def test_unscale_returns_fp32():
    grads = {"w": jnp.full((3,), 256.0, jnp.float16)}
    out = loss_scale.StaticLossScale(128.0).unscale(grads)
    assert out["w"].dtype == jnp.float32
    np.testing.assert_array_equal(out["w"], 2.0)
    assert loss_scale.NoOpLossScale().unscale(grads)["w"].dtype == jnp.float32


def test_all_finite_and_select_tree():
    good = {"a": jnp.ones(3), "ids": jnp.arange(3)}
    bad = {"a": jnp.array([1.0, jnp.nan, 1.0]), "ids": jnp.arange(3)}
    assert bool(loss_scale.all_finite(good))
    assert not bool(loss_scale.all_finite(bad))
    assert not bool(loss_scale.all_finite({"a": jnp.array([jnp.inf], jnp.float16)}))
    assert bool(loss_scale.all_finite({}))
    picked = loss_scale.select_tree(jnp.asarray(False), bad, good)
    np.testing.assert_array_equal(picked["a"], good["a"])


def test_create_loss_scale_auto_and_errors():
    assert isinstance(
        loss_scale.create_loss_scale("auto", "fp16-mixed"), loss_scale.DynamicLossScale
    )
    assert isinstance(loss_scale.create_loss_scale("auto", "bf16-mixed"), loss_scale.NoOpLossScale)
    assert isinstance(loss_scale.create_loss_scale("auto", "fp32"), loss_scale.NoOpLossScale)
    made = loss_scale.create_loss_scale("dynamic", init_scale=8.0, min_scale=2.0, hysteresis=2)
    assert float(made.loss_scale) == 8.0 and float(made.min_scale) == 2.0
    assert float(loss_scale.create_loss_scale("static", init_scale=4.0).loss_scale) == 4.0
    with pytest.raises(ValueError, match="'dinamic'"):
        loss_scale.create_loss_scale("dinamic")


def test_create_loss_scale_checks_the_start_under_jit_too():
    # the trainer builds its scaler inside a jit, where the scaler's fields are tracers
    made = jax.jit(lambda: loss_scale.create_loss_scale("dynamic", init_scale=8.0).loss_scale)
    assert float(made()) == 8.0
    with pytest.raises(ValueError, match=r"init_scale=1000000000.0: outside \[min_scale"):
        jax.jit(lambda: loss_scale.create_loss_scale("dynamic", init_scale=1e9).loss_scale)()


@pytest.mark.parametrize(
    "settings, named",
    [
        (dict(growth_factor=1.0), "growth_factor=1.0"),
        (dict(backoff_factor=1.5), "backoff_factor=1.5"),
        (dict(growth_interval=0), "growth_interval=0"),
        (dict(hysteresis=0), "hysteresis=0"),
        (dict(min_scale=8.0, max_scale=4.0), "min_scale=8.0"),
        (dict(init_scale=-1.0), "init_scale=-1.0"),
    ],
)
def test_bad_settings_are_rejected_by_name_whatever_the_kind(settings, named):
    for kind in ("none", "dynamic"):  # checked even where the kind would not use them
        with pytest.raises(ValueError, match=named):
            loss_scale.create_loss_scale(kind, **settings)
