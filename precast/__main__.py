"""python -m precast: the command line (precast.cli).

Input: the command line. Output: the exit status of ``precast.cli.main``.
"""

import sys

from precast.cli import main

sys.exit(main())
