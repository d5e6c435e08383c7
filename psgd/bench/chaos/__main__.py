"""``python -m psgd.bench.chaos``: the chaos suite's command line (see :mod:`psgd.bench.chaos.suite`)."""

import sys

from psgd.bench.chaos.suite import main

sys.exit(main())
