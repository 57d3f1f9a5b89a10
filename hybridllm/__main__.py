"""`python -m hybridllm ...`: the same CLI as the `hybridllm` command."""

import sys

from hybridllm.entrypoints.cli import main

sys.exit(main())
