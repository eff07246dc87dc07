"""``python -m lcgen ...``: the ``lcgen`` command line (same commands, options, messages and exit
statuses), where the script is not on the PATH."""

import sys

from lcgen.cli import main

sys.exit(main())
