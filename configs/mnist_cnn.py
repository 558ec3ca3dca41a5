"""MNIST with the small CNN of `mptrain.models.cnn`, bf16-mixed.

Needs the TFDS dataset, prepared once (this repository never downloads it):

    tfds build mnist --data_dir=$HOME/tensorflow_datasets
    python -m mptrain.main --config=configs/mnist_cnn.py --workdir=runs/mnist_cnn

Expected: about 99% test accuracy (eval_accuracy >= 0.99, eval_loss <= 0.04) after the 2,000
steps (about 4 epochs), what a network of this shape reaches in flax's MNIST example; minutes
on a CPU. (An estimate: not measured here, as this repository's CI has no copy of MNIST.)
`--config.model.name=mlp` trains the MLP instead (about 98%).

`--config=configs/mnist_cnn.py:tiny` is the test-sized variant, and it does not read MNIST: it
trains on synthetic 28x28x1 images of 10 classes (`data.name = "synthetic_images"`, see
`mptrain/data/synthetic_images.py`), offline and in seconds, with no TensorFlow installed. Only
the full config reads the TFDS dataset.
"""

from ml_collections import config_dict

from mptrain import config as config_lib


def get_config(arg: str | None = None):
    c = config_lib.base_config()
    c.precision = "bf16-mixed"
    c.num_train_steps = 2000
    c.batch_size = 128
    c.log_every_steps = 100
    c.eval_every_steps = 500
    c.eval_steps = 79  # 79 x 128 covers the 10,000 test images (the last batch wraps)
    c.checkpoint_every_steps = 500
    c.optimizer.learning_rate = 1e-3
    c.optimizer.warmup_steps = 100
    c.optimizer.weight_decay = 1e-4

    c.model.name = "cnn"
    c.model.features = (32, 64)  # channels of the two 3x3 conv layers
    c.model.hidden = 256  # width of the dense layer before the head (also the MLP's width)
    c.model.num_classes = 10

    if arg == "tiny":
        # Synthetic images of MNIST's shape and classes: no download, no TensorFlow.
        c.data.name = "synthetic_images"
        c.data.image_shape = (28, 28, 1)
        c.data.num_classes = 10
        c.data.signal = 0.8  # the share of each pixel's variance that is its class's pattern
        c.num_train_steps = 4
        c.batch_size = 8
        c.log_every_steps = 2
        c.eval_every_steps = 4
        c.eval_steps = 2
        c.checkpoint_every_steps = 4
        c.optimizer.warmup_steps = 1
        c.model.features = (4, 8)
        c.model.hidden = 16
    elif arg:
        raise ValueError(f"unknown config argument {arg!r}; valid: 'tiny' or none")
    else:
        c.data.name = "tfds"
        c.data.dataset = "mnist"  # TFDS name
        c.data.train_split = "train"
        c.data.eval_split = "test"
        # a str, None by default: $TFDS_DATA_DIR or ~/tensorflow_datasets (a placeholder, so
        # that --config.data.data_dir=DIR can override it)
        c.data.data_dir = config_dict.placeholder(str)
        c.data.augment = False  # random crops and flips would hurt digits
    return c
