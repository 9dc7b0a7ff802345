"""``python -m rewrite`` == the ``rewrite`` console script."""

import sys

from rewrite.cli import main

sys.exit(main())
