"""``python -m strideweave.finetune MODEL_DIR --data FILE.jsonl --output OUT_DIR --budget SIZE`` (``--help``)."""

import sys

from strideweave.finetune import main

sys.exit(main())
