"""``python -m jaxdist_lessons.planning``: the planner's command line (``cli.main``)."""

import sys

from jaxdist_lessons.planning.cli import main

sys.exit(main())
