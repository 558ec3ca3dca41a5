"""The model and schedule of `lm_bf16.py` under fp16-mixed precision with dynamic loss scaling.

fp16 has 3 more mantissa bits than bf16 but a range that ends at 65504 and underflows below
6e-8, so gradients need a loss scale: it starts at 2**15, halves on every step whose gradients
overflow (that step is skipped, the optimizer untouched) and doubles after 1,000 finite steps.
LayerNorm, softmax, logits and the loss stay in fp32, as in every preset.

    python -m mptrain.main --config=configs/lm_fp16.py --workdir=runs/lm_fp16

Expected (an estimate, not yet measured): the curve of `lm_bf16.py` within noise, around 1.2-1.4
nats/byte at the end, with a few skipped steps early while the scale settles
(`skipped_steps` and `loss_scale` in TensorBoard). `--config=configs/lm_fp16.py:tiny` is the
test-sized variant: `default.py:tiny` under fp16-mixed.
"""

import os
import runpy


def get_config(arg: str | None = None):
    bf16 = runpy.run_path(os.path.join(os.path.dirname(__file__), "lm_bf16.py"))
    c = bf16["get_config"](arg)
    c.precision = "fp16-mixed"
    c.loss_scale.kind = "dynamic"
    c.loss_scale.init_scale = 2.0**15
    c.loss_scale.growth_interval = 1000
    c.loss_scale.hysteresis = 1
    return c
