"""``python -m experiments.tokenizer --data ... --vocab_size ... --kind ... --out ...``: trains a
tokenizer on the documents of ``--data`` (``experiments.tokenizer.train``)."""

import sys

from experiments.tokenizer.train import main

if __name__ == "__main__":
    sys.exit(main())
