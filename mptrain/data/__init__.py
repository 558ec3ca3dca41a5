"""Deterministic batch sources: batch ``i`` is a pure function of ``(seed, i)``.

Each module here (`text`, `tfds`, ...) is a data source `config.data.name` can name. It provides
`create_sources(config) -> (train, eval)`, whose sources have `get_batch(i) -> dict of numpy
arrays` holding the global batch, and `CONFIG_KEYS`: the keys it reads under `config.data`, with
their defaults (`name` and `prefetch` are the base config's). It may provide `check_config(config)`,
a cheap check of those keys that returns the abstract shapes of one example (or None). A resumed
run needs nothing but the step number to continue the data exactly.
"""

from typing import Any

from mptrain import registry


def modules() -> dict[str, Any]:
    """The data sources: `{name: module}` of the modules here with a `create_sources`."""
    return registry.modules(__name__, __path__, "create_sources")


def import_source(name: Any):
    """`mptrain.data.<name>`; a `ValueError` naming `data.name` and the valid names if none."""
    return registry.lookup("data.name", name, modules(), "data source in mptrain.data")


def check_config(config) -> Any:
    """`config.data` checked by its module's own rules; the abstract shapes of one example (a
    dict of `jax.ShapeDtypeStruct`s), or None where they are not known without reading data."""
    module = import_source(config.data.name)
    check = getattr(module, "check_config", None)
    return check(config) if check else None


def check_batch(config, example: Any) -> None:
    """A call's batches (`steps_per_call` of them), as `check_config`'s `example` gives their
    rows, must fit this host, which builds them; else a `ValueError` naming `batch_size`."""
    import math

    import jax

    from mptrain import errors, runtime

    if not example:
        return
    per_example = sum(math.prod(x.shape[1:]) * x.dtype.itemsize for x in jax.tree.leaves(example))
    rows = config.batch_size * config.steps_per_call // jax.process_count()
    need, have = rows * per_example, runtime.host_memory()
    if need > have:
        raise ValueError(
            f"batch_size={config.batch_size}: a call's batches take {errors.bytes_text(need)} on "
            f"this host ({errors.bytes_text(per_example)} an example), more than its "
            f"{errors.bytes_text(have)} of memory; python -m mptrain.plan tells what a batch "
            "needs on an accelerator"
        )


def create_sources(config):
    """Host-side: the `(train, eval)` sources of `mptrain.data.<config.data.name>`."""
    return import_source(config.data.name).create_sources(config)
