"""``python -m kvcodec_tools.shaping`` (``perf/link``): up | down | run -- CMD | check | proxy."""
import sys

from .cli import main

sys.exit(main())
