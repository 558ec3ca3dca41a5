"""scripts/bench.py: its hand-written side trains the same model as mptrain, and it reports."""

import json
import runpy

import jax
import numpy as np
import pytest
from conftest import ROOT

bench = runpy.run_path(str(ROOT / "scripts" / "bench.py"))


@pytest.mark.parametrize(
    "model, case",
    [
        ("lm", "fp32"),
        ("lm", "bf16-mixed"),
        ("lm", "fp16-mixed+dyn"),
        ("resnet", "bf16-mixed+dyn"),
        ("resnet", "bf16-pure"),
    ],
)
def test_the_hand_written_side_trains_the_same_model(model, case, tmp_path):
    """A ratio against the hand-written loop means something only if both sides do the same
    work: from the same init and batches, three steps land on the same params (bf16-pure
    rounds stochastically with other random bits on each side: within one bf16 ulp)."""
    config = bench["load_config"](model, case, "tiny")
    with bench["mptrain_sides"](config, tmp_path) as (_, bare, info, train):
        step, fresh, _ = bench["make_hand"](config, train)
        state = fresh()
        bare(range(3))
        for i in range(3):
            state, _ = step(state, jax.device_put(train.get_batch(i)))
        ours = jax.device_get(info["run"].state.params)
    theirs = jax.device_get(state["params"])
    tolerance = (
        {"rtol": 1e-2, "atol": 1e-2} if case == "bf16-pure" else {"rtol": 2e-3, "atol": 1e-5}
    )
    paths = []
    for (path, a), b in zip(jax.tree.leaves_with_path(ours), jax.tree.leaves(theirs), strict=True):
        assert a.dtype == b.dtype, path
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, err_msg=jax.tree_util.keystr(path), **tolerance)
        paths.append(path)
    assert len(paths) > 4


def test_bench_writes_its_table_and_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench["main"](
        [
            "--models=lm,resnet",
            "--cases=bf16-mixed",
            "--size=tiny",
            "--blocks=1",
            "--block_steps=2",
            f"--out={out}",
        ]
    )
    result = json.loads(out.read_text())
    assert "git_commit" in result and result["device"].startswith("cpu")
    assert [(r["model"], r["case"]) for r in result["rows"]] == [
        ("lm", "bf16-mixed"),
        ("resnet", "bf16-mixed"),
    ]
    for row in result["rows"]:
        assert row["loop_ms"] > 0 and row["hand_ms"] > 0 and row["compile_s"] > 0
        expected = {"lm": 12.0, "resnet": 8.0}[row["model"]]  # adamw; sgd with momentum
        assert row["bytes_per_param"] == row["hand_bytes_per_param"] == expected
        assert (
            row["memory"]["temp_mib"] > 0
            and row["gflop_per_step"] > 0
            and len(row["blocks_ms"]) == 1
        )
    assert "tokens_per_s" in result["rows"][0] and "images_per_s" in result["rows"][1]
    table = capsys.readouterr().out
    assert "loop/hand" in table and "resnet bf16-mixed" in table
