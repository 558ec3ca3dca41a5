"""The fused kernels behind a split sequence's attention (`decoder.context_attention`): cuDNN's
forward and backward as the merge calls them, against the jnp kernel of the same two
functions. They need a GPU with cuDNN (make test-gpu); on a CPU the whole scheme runs with the
jnp kernel in tests/parallel/context_test.py."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import normal

from mptrain.models import attention
from mptrain.models.decoder import context_attention

pytestmark = pytest.mark.skipif(
    not attention.local_backend().cudnn, reason="cuDNN's fused attention: a GPU (make test-gpu)"
)


@pytest.mark.parametrize("causal, kv_len", [(True, None), (False, 96)])
def test_cudnns_forward_and_backward_are_the_reference_kernels(causal, kv_len):
    """bf16 q, k, v (4 query heads over 2), a causal call or one over the first kv_len keys:
    cuDNN's output and log-sum-exp, and its gradients given another call's output and
    log-sum-exp (the merge hands it the merged ones), within bf16's band of the jnp kernel's."""
    t, s = (128, 128) if causal else (128, 256)
    q, k, v, do = (
        normal(i, shape, jnp.bfloat16)
        for i, shape in enumerate([(2, t, 4, 64), (2, s, 2, 64), (2, s, 2, 64), (2, t, 4, 64)])
    )
    args = (q, k, v, kv_len, causal, 0.125)
    o, lse = context_attention.CUDNN.forward(*args)
    want_o, want_lse = context_attention.REFERENCE.forward(*args)
    np.testing.assert_allclose(np.float32(o), np.float32(want_o), atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(lse, want_lse, atol=1e-2, rtol=1e-3)
    # a merged output and log-sum-exp: this call's, its log-sum-exp raised by log 2 (another
    # call's equal share), its output halved
    merged_o, merged_lse = (want_o * 0.5).astype(q.dtype), want_lse + np.log(2.0)
    grads = context_attention.CUDNN.backward(q, k, v, merged_o, merged_lse, do, *args[3:])
    wants = context_attention.REFERENCE.backward(q, k, v, merged_o, merged_lse, do, *args[3:])
    for name, g, w in zip("qkv", grads, wants, strict=True):
        scale = float(jnp.max(jnp.abs(w.astype(jnp.float32))))
        np.testing.assert_allclose(
            np.float32(g), np.float32(w), atol=3e-2 * scale, err_msg=f"d{name}"
        )
