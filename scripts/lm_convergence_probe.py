"""How fast does the byte-level LM converge on this machine? A plain flax + optax loop.

Trains ``TransformerLM`` on the stdlib text under a chosen precision (params fp32; compute in
``--compute``), with AdamW (weight decay on matrices only), linear warmup + cosine decay to 10% and
global-norm clipping, and prints elapsed wall and CPU time, steps/s and train / eval loss (nats per
byte) as it goes. Periodic evals use the first ``--eval_batches`` eval batches; the final eval
covers the whole held-out split (last 1% of the corpus). Used to pick the default config.

  python scripts/lm_convergence_probe.py                      # the recommended default
  python scripts/lm_convergence_probe.py --steps=600 --lr=5e-3

Measured on a shared 2-core CPU (Sapphire Rapids, jax 0.10.2), bf16 compute, with the defaults
(d_model 128, 2 layers, 4 heads, d_ff 512, seq_len 128, batch 32, lr 3e-3, warmup 50, 800 steps):
final eval 1.490 nats/byte (2.15 bits) after about 390 CPU-seconds of training; 600 steps: 1.592.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mptrain.data import text
from mptrain.models import transformer_lm

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--num_heads", type=int, default=4)
    p.add_argument("--d_ff", type=int, default=0, help="0: 4 * d_model")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--b2", type=float, default=0.99)
    p.add_argument("--compute", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--log_every", type=int, default=100)
    p.add_argument("--eval_every", type=int, default=200)
    p.add_argument("--eval_batches", type=int, default=2, help="batches per periodic eval")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max_seconds", type=float, default=0.0, help="stop training after this")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    compute_dtype = DTYPES[args.compute]
    t0 = time.perf_counter()
    train_data, eval_data = text.split_corpus(text.load_corpus())
    train_src = text.TextSource(train_data, args.seq_len, args.batch_size, args.seed)
    eval_src = text.TextSource(eval_data, args.seq_len, 64, random=False)
    print(
        f"data: {len(train_data)} train bytes, {len(eval_data)} eval bytes "
        f"({time.perf_counter() - t0:.2f}s)"
    )

    model = transformer_lm.TransformerLM(
        d_model=args.d_model, num_layers=args.num_layers, num_heads=args.num_heads,
        d_ff=args.d_ff or 4 * args.d_model, max_len=args.seq_len, dtype=compute_dtype,
    )  # fmt: skip
    params = model.init(jax.random.key(args.seed), jnp.zeros((1, args.seq_len), jnp.int32))
    num_params = sum(x.size for x in jax.tree.leaves(params))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, args.warmup, args.steps, end_value=args.lr * 0.1
    )
    decay_mask = jax.tree.map(lambda x: x.ndim >= 2, params)
    tx = optax.chain(
        optax.clip_by_global_norm(args.clip),
        optax.adamw(schedule, b2=args.b2, weight_decay=args.weight_decay, mask=decay_mask),
    )
    opt_state = tx.init(params)
    to_compute = functools.partial(jax.tree.map, lambda x: x.astype(compute_dtype))

    def loss_fn(params, batch):
        logits = model.apply(to_compute(params), batch["inputs"])
        return transformer_lm.lm_loss(logits, batch["targets"])

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    eval_step = jax.jit(loss_fn)

    def evaluate(num_batches):
        losses = [eval_step(params, eval_src.get_batch(i)) for i in range(num_batches)]
        return float(np.mean(jax.device_get(losses)))

    print(f"model: {num_params / 1e6:.2f}M params, compute {args.compute}; {vars(args)}")
    print(f"{'time':>7} {'cpu':>7} {'step':>6} {'steps/s':>8} {'train':>7} {'eval':>7}")
    t_start, c_start = time.perf_counter(), time.process_time()
    t_last, step_last, losses = t_start, 0, []
    for step in range(1, args.steps + 1):
        params, opt_state, loss = train_step(params, opt_state, train_src.get_batch(step - 1))
        losses.append(loss)
        last = step == args.steps or (
            args.max_seconds and time.perf_counter() - t_start > args.max_seconds
        )
        if step % args.log_every == 0 or last:
            train_loss = float(np.mean(jax.device_get(losses)))
            losses = []
            now = time.perf_counter()
            rate = (step - step_last) / (now - t_last)
            eval_loss = ""
            if step % args.eval_every == 0 and not last:
                eval_loss = f"{evaluate(args.eval_batches):7.3f}"
            cpu = time.process_time() - c_start
            print(f"{now - t_start:7.1f} {cpu:7.1f} {step:6d} {rate:8.2f} {train_loss:7.3f} "
                  f"{eval_loss:>7}", flush=True)  # fmt: skip
            t_last, step_last = time.perf_counter(), step
        if last:
            break
    t_train = time.perf_counter() - t_start
    final = evaluate(eval_src.num_batches)
    t_total = time.perf_counter() - t_start
    cpu = time.process_time() - c_start
    print(f"final eval (all {eval_src.num_batches} batches): {final:.4f} nats/byte "
          f"({transformer_lm.bits_per_byte(final):.3f} bits); train {t_train:.1f}s, "
          f"train+eval {t_total:.1f}s (cpu {cpu:.1f}s), "
          f"total incl. data {time.perf_counter() - t0:.1f}s")  # fmt: skip


if __name__ == "__main__":
    main()
