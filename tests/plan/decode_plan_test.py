"""The 8B's decoding step compiled for an H100 here (issue 45): the bytes a token moves are
within 20% of reading the weights and the KV cache once, and no token holds an [S, S] array."""

import json

import pytest
from helpers import ROOT

from mptrain import plan as plan_lib

pytestmark = [
    pytest.mark.plan,
    pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry"),
]


def test_a_token_of_the_8b_reads_its_weights_and_cache_about_once(tmp_path, capsys):
    code = plan_lib.main(
        ["plan", f"--config={ROOT / 'configs' / 'llama3.py'}:8b", "--target=h100", "--decode",
         f"--json={tmp_path / 'd.json'}"]
    )  # fmt: skip
    assert code == 0 and "moved / floor" in capsys.readouterr().out
    out = json.loads((tmp_path / "d.json").read_text())
    assert 15.0e9 < out["floor_bytes"] < 15.5e9  # 8.03 B params in bf16, one embedding row
    assert out["ratio"] < 1.2, out["ratio"]  # a stack sliced every token read 3x (red then)
    assert out["square_buffers"] == [] and out["temporaries_mib"] < 512
    print(
        f"8B decode on an H100: {out['bytes_moved'] / 1e9:.2f} GB a token, floor "
        f"{out['floor_bytes'] / 1e9:.2f} GB ({out['ms_moved']:.2f} vs {out['ms_floor']:.2f} ms)"
    )
