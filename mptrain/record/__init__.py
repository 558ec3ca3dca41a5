"""What a run writes down: metrics, logs, curves, speed and traces.

`metrics` (TensorBoard events without TensorFlow, the start-up lines, the progress line),
`loggers` (W&B, MLflow), `curves` (`history.jsonl`, `curves.png`), `log_totals` (what a log step
adds up on the devices), `throughput` (tokens/s, MFU, goodput), `numerics_log` (per-layer tables)
and `profile` (the traced steps and their kernel table). It may import `inspect`, `config`,
`models`, `recipe` and the base modules, never `train`.
"""
