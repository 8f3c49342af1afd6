"""``python -m flaxformer_lite.train``: the same as ``python train.py``."""

import sys

from flaxformer_lite.cli.train import train_main

if __name__ == "__main__":
    sys.exit(train_main())
