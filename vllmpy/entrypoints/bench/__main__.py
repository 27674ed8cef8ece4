"""`python -m vllmpy.entrypoints.bench` = the vllm-bench console script."""
import sys

from vllmpy.entrypoints.bench import main

sys.exit(main())
