"""python -m lever: the `lever` command."""

import sys

from lever.cli.main import main

sys.exit(main())
