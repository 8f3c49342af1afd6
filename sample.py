"""Continue prompts (or translate) with a trained run or a Hugging Face checkpoint directory,
like nanoGPT's sample.py.

    python sample.py --run-dir runs/default --prompt "012+034="
    python sample.py --run-dir runs/default --prompt "007-002=" --temperature 0.8 --num-samples 3
    python sample.py --hf-dir checkpoints/gpt2 --prompt "Hello, my name is"

Same options as ``flaxformer-lite generate`` (``--help`` lists them).
"""

import sys

from flaxformer_lite.cli.generate import generate_main

if __name__ == "__main__":
    sys.exit(generate_main(prog="sample.py"))
