"""Writes transformers' own figures for `tests/models/moe_test.py` (run in a venv of its own,
as tests/hf/make_fixture.py is):

    /tmp/hfvenv/bin/python tests/models/make_moe_fixture.py

`tests/models/moe_fixture.npz`: for Qwen3-MoE's sparse block (8 experts, top 2, renormalised)
and Mixtral's (4 experts, top 2), fp32, random weights of order one: the block's input `x`
`[1, 12, 16]`, its router weight `router` `[E, D]`, the experts' `gate`, `up` `[E, F, D]` and
`down` `[E, D, F]` (torch's `[out, in]`), and its output `y`; and `aux_logits` (two layers' router
logits, `[2, 12, 8]`) with `aux_loss`, transformers' `load_balancing_loss_func` of them (top 2).
"""

from pathlib import Path

import numpy as np
import torch
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral import modeling_mixtral
from transformers.models.qwen3_moe import modeling_qwen3_moe

OUT = Path(__file__).resolve().with_name("moe_fixture.npz")


def block(module, generator, name: str, out: dict) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)
        x = torch.randn(1, 12, 16, generator=generator)
        y = module(x)
        y = y[0] if isinstance(y, tuple) else y
    experts = module.experts
    gate, up = experts.gate_up_proj.detach().chunk(2, dim=1)
    out.update({
        f"{name}_x": x.numpy(), f"{name}_y": y.numpy(),
        f"{name}_router": module.gate.weight.detach().numpy(),
        f"{name}_gate": gate.numpy(), f"{name}_up": up.numpy(),
        f"{name}_down": experts.down_proj.detach().numpy(),
    })  # fmt: skip


def main() -> None:
    generator, out = torch.Generator().manual_seed(0), {}
    shapes = dict(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    qwen = Qwen3MoeConfig(moe_intermediate_size=8, num_experts=8, num_experts_per_tok=2,
                          norm_topk_prob=True, **shapes)  # fmt: skip
    block(modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(qwen), generator, "qwen3_moe", out)
    mixtral = MixtralConfig(intermediate_size=8, num_local_experts=4, num_experts_per_tok=2,
                            **shapes)  # fmt: skip
    block(modeling_mixtral.MixtralSparseMoeBlock(mixtral), generator, "mixtral", out)
    logits = torch.randn(2, 12, 8, generator=generator)
    loss = modeling_qwen3_moe.load_balancing_loss_func(tuple(logits), 8, 2)
    out.update(aux_logits=logits.numpy(), aux_loss=np.float32(loss.item()))
    np.savez(OUT, **out)
    print("wrote", OUT, {k: v.shape for k, v in out.items()})


if __name__ == "__main__":
    main()
