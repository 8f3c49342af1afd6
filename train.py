"""Train a flaxformer_lite model (``python train.py --help``); the same command again resumes."""

import sys

from flaxformer_lite.cli.train import train_main

if __name__ == "__main__":
    sys.exit(train_main())
