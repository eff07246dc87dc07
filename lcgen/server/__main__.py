"""``python -m lcgen.server MODEL [options]``: serve a model over an OpenAI-compatible HTTP API,
the same as ``lcgen serve`` (same options, messages and exit statuses)."""

import sys

from lcgen.server import main

sys.exit(main())
