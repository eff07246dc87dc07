"""``python -m lcgen.server MODEL [--host] [--port] [--api-key] [--n-ctx] [--n-seq-max]
[--threads]``: serve a model over an OpenAI-compatible HTTP API."""

import sys

from lcgen.server import main

sys.exit(main())
