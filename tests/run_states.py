"""The state a run's newest checkpoint holds, restored on one device into the structure the loop
builds (its shapes traced, nothing computed): for tests that compare two runs' parameters and
optimizer state array by array."""

import jax
from flax import nnx

from flaxformer_lite.train.checkpoint import Checkpointer
from flaxformer_lite.train.checkpoint_format import to_savable
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.optim import make_optimizer
from flaxformer_lite.train.program import make_train_state


def checkpointed_state(run_dir, step: int):
    """The checkpointed parameters and optimizer state of ``run_dir``, which must be at
    ``step``."""
    cfg = load_config(run_dir / "config.yaml")
    tx, _ = make_optimizer(cfg.optimizer, cfg.model, total_steps=cfg.train.steps)

    def savable():  # a LoRA run's: its adapters, not the base
        return to_savable(nnx.split(make_train_state(cfg, tx))[1])

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        jax.eval_shape(savable),
    )
    with Checkpointer(run_dir / "checkpoints", keep=3) as checkpointer:
        restored = checkpointer.restore(abstract)
    assert restored.step == step
    return restored.state
