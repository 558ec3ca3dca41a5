"""Training: the Trainer, its loop, its checkpoints, and how a run starts.

`trainer` (the hooks a user overrides), `loop` (the steps, the record, the stops), `launch`
(config to exit code), `checkpoint` with `checkpoint_meta` and `fingerprints` (what a checkpoint
holds and which run it belongs to), and `init_from` (step 0 from a HuggingFace folder or another
run). It may import everything below it: `record`, `inspect`, `hf`, `config`, `data`, `models`,
`recipe` and the base modules; only the command lines (`main`, `export`, `plan`) import it.
"""
