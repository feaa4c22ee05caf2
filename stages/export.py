"""export stage: the best checkpoint to TorchScript and ONNX, with a parity check on the test split."""

import sys

from cnnpipe.export import main

if __name__ == "__main__":
    sys.exit(main())
