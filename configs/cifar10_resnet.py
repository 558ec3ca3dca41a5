"""CIFAR-10 with ResNet-18, fp16-mixed with dynamic loss scaling.

fp16 compute with fp32 master weights, a dynamic loss scale (starting at 2**15, halved on each
overflow, doubled after 2,000 finite steps), and BatchNorm statistics kept in fp32. Needs the
TFDS dataset, prepared once (this repository never downloads it):

    tfds build cifar10 --data_dir=$HOME/tensorflow_datasets
    python -m mptrain.main --config=configs/cifar10_resnet.py --workdir=runs/cifar10_resnet

Expected: about 94-95% test accuracy (eval_accuracy >= 0.94) after the 15,000 steps (about 38
epochs of 50,000 images, SGD with Nesterov momentum, cosine decay, crop-and-flip augmentation),
as the standard recipe reaches; an hour or so on one GPU, far too long on a CPU. A handful of
steps is skipped at the start while the loss scale settles (`skipped_steps` in TensorBoard).
(Not measured in this repository's CI, which has no copy of CIFAR-10.)

`--config=configs/cifar10_resnet.py:tiny` is the test-sized variant, and it does not read
CIFAR-10: it trains on synthetic 32x32x3 images of 10 classes (`data.name = "synthetic_images"`,
see `mptrain/data/synthetic_images.py`; no augmentation), offline and in seconds, with no
TensorFlow installed. Only the full config reads the TFDS dataset.
"""

from ml_collections import config_dict

from mptrain import config as config_lib


def get_config(arg: str | None = None):
    c = config_lib.base_config()
    c.precision = "fp16-mixed"
    c.num_train_steps = 15_000
    c.batch_size = 128
    c.log_every_steps = 100
    c.eval_every_steps = 1000
    c.eval_steps = 79  # 79 x 128 covers the 10,000 test images (the last batch wraps)
    c.checkpoint_every_steps = 1000

    c.loss_scale.kind = "dynamic"
    c.loss_scale.init_scale = 2.0**15
    c.loss_scale.growth_interval = 2000

    c.optimizer.name = "sgd"
    c.optimizer.learning_rate = 0.1
    c.optimizer.momentum = 0.9
    c.optimizer.nesterov = True
    c.optimizer.weight_decay = 5e-4
    c.optimizer.schedule = "cosine"
    c.optimizer.warmup_steps = 400
    c.optimizer.grad_clip_norm = 0.0  # no clipping: the schedule and BatchNorm keep it stable

    c.model.name = "resnet"
    c.model.stage_sizes = (2, 2, 2, 2)  # basic blocks per stage: ResNet-18
    c.model.width = 64  # channels of the first stage, doubled at each later one
    c.model.num_classes = 10
    c.model.bn_momentum = 0.9  # decay of the running batch statistics

    if arg == "tiny":
        # Synthetic images of CIFAR-10's shape and classes: no download, no TensorFlow.
        c.data.name = "synthetic_images"
        c.data.image_shape = (32, 32, 3)
        c.data.num_classes = 10
        c.data.signal = 0.8  # the share of each pixel's variance that is its class's pattern
        c.num_train_steps = 4
        c.batch_size = 8
        c.log_every_steps = 2
        c.eval_every_steps = 4
        c.eval_steps = 2
        c.checkpoint_every_steps = 4
        c.optimizer.warmup_steps = 1
        # Two stages of one block: the structure (a projection included) at a fraction of the
        # compile time of four.
        c.model.stage_sizes = (1, 1)
        c.model.width = 4
    elif arg:
        raise ValueError(f"unknown config argument {arg!r}; valid: 'tiny' or none")
    else:
        c.data.name = "tfds"
        c.data.dataset = "cifar10"  # TFDS name
        c.data.train_split = "train"
        c.data.eval_split = "test"
        # a str, None by default: $TFDS_DATA_DIR or ~/tensorflow_datasets (a placeholder, so
        # that --config.data.data_dir=DIR can override it)
        c.data.data_dir = config_dict.placeholder(str)
        c.data.augment = True  # random crops of the 4-pixel-padded image, random flips
    return c
